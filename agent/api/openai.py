"""The OpenAI wire format: request bodies parsed into `ParsedRequest` (the prompt's ids and the one
`SamplingParams`), chat templates, and the response / stream-chunk / error objects. No torch here.

Parsing is strict about what we act on and lenient about the rest: unknown fields are ignored (the
official clients send several we do not use), every field we use is type-checked here (pydantic) and
value-checked where the engine checks it (`SamplingParams`, `check_prompt`), plus this service's
limits and OpenAI's own ranges. Every failure is an `InvalidRequest` (`BadRequest` for the wire's
own) whose `param` names the field, so the API answers 400, never 500.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional, Protocol, Union

import jinja2
import jinja2.sandbox
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from agent.api.extension import ExitPolicy, OrinAgentOptions, exit_mode
from agent.api.logprobs import parse_logprobs
from agent.engine.types import InvalidRequest, SamplingParams, Usage, check_prompt

Number = Union[StrictInt, StrictFloat]

# A chat template for models that ship none: plain "role: content" turns, then the assistant's cue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class BadRequest(InvalidRequest):
    """A body the wire format refuses (not JSON, wrong type, unsupported field)."""


class PromptTokenizer(Protocol):
    """What parsing needs of partition.tokenizer.Tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    repetition_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[dict[str, Any]] = None
    n: Optional[StrictInt] = 1
    priority: Optional[Literal["interactive", "background"]] = None
    ignore_eos: Optional[StrictBool] = False
    user: Optional[StrictStr] = None
    logit_bias: Optional[dict[str, Number]] = None
    # completions: an integer 0..5 (top alternatives); chat: a boolean, with top_logprobs 0..20
    logprobs: Optional[Union[StrictBool, StrictInt]] = None
    top_logprobs: Optional[StrictInt] = None
    # Accepted by OpenAI's API, not by this service: refused with 400 unless given as their no-op value.
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None
    orin_agent: Optional[OrinAgentOptions] = None  # this service's extension (agent.api.extension)


class CompletionBody(_Base):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    echo: Optional[StrictBool] = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_Base):
    messages: list[Message] = Field(min_length=1)


@dataclass(frozen=True)
class Limits:
    """This service's bounds on a request (below what the engine could run)."""

    context: int  # the engine's max_seq
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_tokens: int
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    max_prompt_chars: int = 0  # a text longer than this cannot fit max_prompt_tokens (0 = no check)
    exits: ExitPolicy = ExitPolicy()  # early exits / self-speculation: offered or not, and the defaults


def prompt_char_limit(vocab: Iterable[str], max_prompt_tokens: int) -> int:
    """The most characters a prompt of `max_prompt_tokens` tokens can have: no token stands for more
    characters than its vocabulary string has (byte-level and sentencepiece pieces decode to at most
    as many characters), so a longer text is refused before it is tokenised. Twice that, for
    normalizers that drop characters."""
    longest = max((len(t) for t in vocab), default=1)
    return 2 * max(1, longest) * max_prompt_tokens


# Integers past this many digits are not numbers any field takes (Python refuses to parse more than
# 4300 digits with a ValueError that names no field); they parse as `_HugeInt` and fail validation.
MAX_INT_DIGITS = 40


class _HugeInt:
    """A JSON integer with more than MAX_INT_DIGITS digits: no field accepts it."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    return _HugeInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _bad_string(value: Any, where: str) -> str | None:
    """The path of the first string (or key) in `value` that is not encodable text (a lone surrogate
    such as "\\ud800", which JSON allows and a tokenizer cannot take), or None."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                key_at = f"{at}.{k}" if at else str(k)
                if _bad_string(k, key_at) is not None:
                    return at or "body"
                stack.append((item, key_at))
        elif isinstance(v, list):
            stack.extend((item, f"{at}.{i}" if at else str(i)) for i, item in enumerate(v))
    return None


@dataclass(frozen=True)
class ParsedRequest:
    kind: Literal["completion", "chat"]
    prompt_ids: list[int]
    prompt_text: str
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    priority: str
    model: str | None


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    bad = _bad_string(data, "")
    if bad is not None:
        raise BadRequest(f"{bad}: not valid Unicode text (a lone surrogate such as \\ud800)", bad)
    return data


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return f"{loc or 'body'}: {err.get('msg', 'invalid value')}", loc or None


def _finite(name: str, v: float | None, lo: float, hi: float, default: float) -> float:
    """The wire's range for a float field (OpenAI's API reference: temperature 0..2, top_p 0..1), on
    top of what SamplingParams itself requires."""
    if v is None:
        return default
    v = float(v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be a number in [{lo}, {hi}], got {v}", name)
    return v


# Below this a temperature is greedy: dividing logits by 1e-126 overflows to inf (vLLM uses 1e-5 too).
SAMPLING_EPS = 1e-5


def _temperature(v: float | None) -> float:
    t = _finite("temperature", v, 0.0, 2.0, 1.0)  # OpenAI's default is 1
    return 0.0 if t < SAMPLING_EPS else t


def render_chat(template: str | None, messages: list[Message], eos_token: str = "", bos_token: str = "") -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise BadRequest(f"the model's chat template refused the messages: {msg}", "messages")

    env.globals["raise_exception"] = raise_exception
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return env.from_string(template or DEFAULT_CHAT_TEMPLATE).render(
            messages=msgs, add_generation_prompt=True, eos_token=eos_token, bos_token=bos_token)
    except jinja2.TemplateError as exc:
        raise BadRequest(f"cannot apply the chat template: {exc}", "messages") from None


def _unsupported(name: str, what: str) -> BadRequest:
    return BadRequest(f"{name} is not supported by this service ({what})", name, "unsupported_parameter")


def _refuse_unsupported(body: "_Base") -> None:
    """OpenAI's fields this service cannot honour: a 400 naming the field, never a silent ignore."""
    if body.tools or body.functions:
        raise _unsupported("tools" if body.tools else "functions", "no tool calling")
    if body.tool_choice not in (None, "none") or body.function_call not in (None, "none"):
        raise _unsupported("tool_choice" if body.tool_choice not in (None, "none") else "function_call",
                           "no tool calling")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise _unsupported("response_format", "text only; no JSON mode or schemas")
    if body.suffix:
        raise _unsupported("suffix", "no insertion")
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", "one candidate per request")
    if getattr(body, "echo", False):
        raise _unsupported("echo", "the prompt is not echoed")


# OpenAI's API reference: logit_bias values are in [-100, 100]. Keys: token ids in 1-10 ASCII digits
# (str.isdigit() also takes "²", which int() refuses, and int() refuses over 4,300 digits).
LOGIT_BIAS_RANGE, TOKEN_ID_MAX_DIGITS = 100.0, 10


def _logit_bias(bias: dict[str, Any] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not (0 < len(key) <= TOKEN_ID_MAX_DIGITS and key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise BadRequest(f"logit_bias: keys must be token ids in [0, {vocab_size}) in ASCII digits, got "
                             f"{key[:40]!r}{f'... ({len(key)} characters)' if len(key) > 40 else ''}", "logit_bias")
        v = float(value)
        if not math.isfinite(v) or abs(v) > LOGIT_BIAS_RANGE:
            raise BadRequest(f"logit_bias: values must be in [-100, 100], got {value!r}", "logit_bias")
        out.append((int(key), v))
    if len(out) > 300:  # OpenAI's own cap on the map's size
        raise BadRequest("logit_bias: at most 300 entries", "logit_bias")
    return tuple(out)


def _check_chars(text: str, limits: Limits, param: str) -> None:
    if limits.max_prompt_chars and len(text) > limits.max_prompt_chars:
        raise BadRequest(f"{param}: {len(text)} characters cannot fit in {limits.max_prompt_tokens} tokens "
                         f"(this service's prompt limit); shorten it", param, "context_length_exceeded")


def parse_request(kind: Literal["completion", "chat"], raw: bytes, tokenizer: PromptTokenizer, limits: Limits,
                  chat_template: str | None = None, eos_token: str = "") -> ParsedRequest:
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body: _Base = (CompletionBody if kind == "completion" else ChatBody).model_validate(data)
    except ValidationError as exc:
        raise BadRequest(*_validation_message(exc)) from None
    if body.n not in (None, 1):
        raise BadRequest("n must be 1 (one choice per request)", "n")
    _refuse_unsupported(body)
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(body, name)
        if v not in (None, 0, 0.0):
            raise BadRequest(f"{name} is not supported (use repetition_penalty)", name)
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                      limits.default_max_tokens)
    if max_tokens > limits.max_output_tokens:
        raise BadRequest(f"max_tokens must be between 1 and {limits.max_output_tokens}, got {max_tokens}",
                         "max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > limits.max_stop_strings or any(len(s) > limits.max_stop_chars for s in stop):
        raise BadRequest(f"stop: at most {limits.max_stop_strings} non-empty strings of at most "
                         f"{limits.max_stop_chars} characters", "stop")
    logprobs = parse_logprobs(kind, body.logprobs, body.top_logprobs)
    speculate, md = exit_mode(body.orin_agent, limits.exits, logprobs is not None)
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=_temperature(body.temperature),
        top_k=0 if body.top_k is None else body.top_k, top_p=_finite("top_p", body.top_p, 1e-9, 1.0, 1.0),
        repetition_penalty=_finite("repetition_penalty", body.repetition_penalty, 1e-3, 10.0, 1.0),
        seed=body.seed, stop=stop, ignore_eos=bool(body.ignore_eos), speculate=speculate, max_disagreement=md,
        logit_bias=_logit_bias(body.logit_bias, tokenizer.vocab_size), logprobs=logprobs)
    include_usage = bool(body.stream_options and body.stream_options.get("include_usage") is True)

    if isinstance(body, CompletionBody):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise BadRequest("prompt: one prompt per request (a list of one string at most)", "prompt")
            p = p[0]
        if isinstance(p, str):
            _check_chars(p, limits, "prompt")
            text, ids = p, tokenizer.encode(p) if p else []
        else:
            ids = list(p)
            if any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise BadRequest(f"prompt: token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            text = ""
    else:
        _check_chars("".join(m.text() for m in body.messages), limits, "messages")  # type: ignore[attr-defined]
        text = render_chat(chat_template, body.messages, eos_token)  # type: ignore[attr-defined]
        ids = tokenizer.encode(text)
    check_prompt(ids, limits.context, limits.max_prompt_tokens, "prompt" if kind == "completion" else "messages")
    return ParsedRequest(kind, ids, text, sampling, bool(body.stream), include_usage,
                         body.priority or "interactive", body.model)


# -- responses -----------------------------------------------------------------------------------

def usage_dict(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "energy_joules": None if u.energy_joules is None else round(u.energy_joules, 6),
            "ttft_s": None if u.ttft_s is None else round(u.ttft_s, 6),
            "decode_tokens_per_s": None if u.decode_tok_s is None else round(u.decode_tok_s, 3)}


def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def completion_response(rid: str, model: str, kind: str, text: str, reason: str, usage: Usage,
                        logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    now = int(time.time())
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish_reason(reason), "logprobs": logprobs}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": now, "model": model, "choices": [choice],
            "usage": usage_dict(usage)}


def stream_chunk(rid: str, model: str, kind: str, created: int, text: str | None = None,
                 reason: str | None = None, first: bool = False, usage: Usage | None = None,
                 no_choices: bool = False, logprobs: dict[str, Any] | None = None) -> str:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    doc: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [] if no_choices else [choice]}
    if usage is not None:
        doc["usage"] = usage_dict(usage)
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
