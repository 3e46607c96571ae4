"""OpenAI's logprobs fields parsed (`parse_logprobs`), and its two logprobs objects from the engine's `TokenLogprob`s: the legacy completions one
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat one (`content`, a list of
`{token, logprob, bytes, top_logprobs}`). Token texts come from the tokenizer's decode of one id.
No torch here. The numbers are those of the distribution each token was drawn from (see
agent.engine.sampling.token_logprob).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from agent.engine.types import MAX_LOGPROBS, InvalidRequest, TokenLogprob

TokenText = Callable[[int], str]

# OpenAI's API reference: the legacy completions' logprobs is at most 5.
MAX_COMPLETION_LOGPROBS = 5


def parse_logprobs(kind: str, logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
    """How many top alternatives to return with each token (None: no logprobs), by OpenAI's rules:
    completions take `logprobs: int` in 0..5; chat takes `logprobs: bool` and `top_logprobs` in
    0..20, the latter only with logprobs true."""
    if kind == "completion":
        if top_logprobs is not None:
            raise InvalidRequest("top_logprobs is a chat field; /v1/completions takes logprobs (an integer 0..5)",
                                 "top_logprobs")
        if logprobs is None:
            return None
        if isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS}, got {logprobs!r}",
                                 "logprobs")
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest("logprobs must be a boolean on /v1/chat/completions (top_logprobs gives the count)",
                             "logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {top_logprobs}", "top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def _entry(text: TokenText, token: int, logprob: float) -> dict[str, Any]:
    s = text(token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one stream chunk)."""
    return {"content": [{**_entry(text, e.token, e.logprob),
                         "top_logprobs": [_entry(text, t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> tuple[dict[str, Any], int]:
    """`choices[].logprobs` of a completion (or of one stream chunk, whose `text_offset`s continue
    from `offset`, the characters of completion before it), and the offset after it. As OpenAI's,
    each `top_logprobs` map holds the top alternatives plus the sampled token."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        s = text(e.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top = {text(t): lp for t, lp in e.top}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset
