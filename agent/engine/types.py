"""The engine's vocabulary, free of torch: the one validated `SamplingParams`, the one prompt check
(`check_prompt`), a request, the step contract between scheduler and executor (`StepPlan` in,
`StepOutput` out), what a request's caller receives (`Delta`, `Finished` with its `Usage`), the phase
event the power controller listens to, and the interfaces the engine is handed (executor, energy
meter, metrics).

Every check of a request's values is here: `SamplingParams.__post_init__` for the sampling
parameters and `check_prompt` for the prompt (the one check that needs the tokenizer's ids). Both
raise `InvalidRequest`, whose `param` names the offending field, so the API answers 400 naming it
and the CLI prints one line.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Protocol, Sequence

INTERACTIVE = 0
BACKGROUND = 1
PRIORITIES = {"interactive": INTERACTIVE, "background": BACKGROUND}


class InvalidRequest(ValueError):
    """A request that can never run as given (bad parameter, empty or too long prompt); the message
    says what to do and `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code where it has one (context_length_exceeded, ...)


class QueueFull(RuntimeError):
    """The wait queue is at its bound; retry after `retry_after_s`."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"the request queue is full ({depth} waiting); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class EngineStopped(RuntimeError):
    """The engine is shutting down (or stopped) and takes no new requests."""


MAX_LOGPROBS = 20  # OpenAI's API reference: top_logprobs is 0..20
MAX_SPECULATE = 16  # draft tokens per self-speculative round, at most


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and its row's `top` alternatives, (token id, logprob) best
    first, under the distribution the token was drawn from (see agent.engine.sampling.token_logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    speculate: int = 0  # draft tokens per self-speculative round (0 = off); the output is unchanged
    max_disagreement: float | None = None  # early exits allowed up to this rate of disagreement
    logprobs: int | None = None  # each emitted token's log-probability and this many top alternatives; None = off

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
             f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, "top_k", f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            # torch.Generator.manual_seed takes 64 bits; the API's JSON integers stay in the signed range
            (self.seed is None or 0 <= self.seed < 2 ** 63, "seed", "seed must be in [0, 2**63)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (0 <= self.speculate <= MAX_SPECULATE, "speculate",
             f"speculate must be in 0..{MAX_SPECULATE} draft tokens, got {self.speculate}"),
            (self.max_disagreement is None or 0 <= self.max_disagreement < 1, "max_disagreement",
             f"max_disagreement must be in [0, 1), got {self.max_disagreement}"),
            (not (self.speculate and self.max_disagreement is not None), "speculate",
             "speculate (lossless) and max_disagreement (early exits) are two modes: give one"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in 0..{MAX_LOGPROBS} top alternatives, got {self.logprobs}"),
            (self.logprobs is None or (not self.speculate and self.max_disagreement is None), "logprobs",
             "logprobs are not returned by speculative or early-exit decoding: drop speculate / "
             "max_disagreement, or drop logprobs"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)


def check_prompt(prompt_ids: Sequence[int], max_seq: int, max_prompt_tokens: int | None = None,
                 param: str = "prompt") -> None:
    """The prompt check: at least one token, and room in a context of `max_seq` tokens for at least
    one more; `max_prompt_tokens` is a service's own, lower, bound."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty: give at least one token of text", param)
    if max_prompt_tokens is not None and n > max_prompt_tokens:
        raise InvalidRequest(f"the prompt is {n} tokens; this service takes at most {max_prompt_tokens}", param,
                             "context_length_exceeded")
    if n >= max_seq:
        raise InvalidRequest(f"the prompt is {n} tokens but the context holds {max_seq}; shorten the prompt "
                             "or raise the context (--max-seq, up to the model's max_position_embeddings)",
                             param, "context_length_exceeded")


@dataclass(frozen=True)
class SeqRequest:
    """One request as the engine holds it: the prompt's ids and its one `SamplingParams`."""

    req_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = INTERACTIVE

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES.values():
            raise InvalidRequest(f"priority must be one of {', '.join(PRIORITIES)}", "priority")


# -- the step contract -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SeqChunk:
    """One row of a step: `token_ids` go in at positions start_pos.. of cache row `slot`."""

    req_id: str
    slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool  # the row's logits give the request's next token
    sampling: SamplingParams | None = None  # the request's first chunk only: the executor makes its sampler
    blocks: tuple[int, ...] = ()  # paged KV-cache: the sequence's block table (empty: the cache row `slot`)


@dataclass(frozen=True)
class StepPlan:
    kind: Literal["prefill", "decode"]
    chunks: tuple[SeqChunk, ...]
    released: tuple[str, ...] = ()  # requests gone since the last step: the executor drops their state

    @property
    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def context(self) -> int:
        """The longest context (cache positions in use after this step) in the batch."""
        return max(c.start_pos + len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class DepthStats:
    """What early exits and self-speculation did in one step (agent.engine.speculative), for metrics:
    the depth each emitted token's logits were read at, deep passes, drafts and accepted lengths."""

    n_layers: int
    exits: tuple[tuple[int, int], ...] = ()  # (layer the logits were read after, tokens); n_layers = full depth
    deep_passes: int = 0  # runs of the last slice
    drafted: int = 0  # draft tokens proposed
    accepted: tuple[int, ...] = ()  # per speculative round: draft tokens the full model accepted

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.exits)


@dataclass(frozen=True)
class StepOutput:
    tokens: Mapping[str, int]  # req_id -> sampled token, for chunks with sample=True
    elapsed_s: float = 0.0
    # req_id -> tokens accepted after tokens[req_id] in the same step (speculative decoding); every
    # emitted token but the row's last is already in the cache
    more: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # req_id -> one entry per emitted token (tokens[req_id], then more[req_id]), for rows whose
    # SamplingParams.logprobs is set
    logprobs: Mapping[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    depth: DepthStats | None = None  # rows that exited early or speculated in this step (None: none did)


@dataclass(frozen=True)
class TokenEvent:
    req_id: str
    token: int | None  # None when the request ended without a new token (EOS)
    finish_reason: str | None = None  # "stop" (EOS), "length"; None while running
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


# -- what the caller of a request receives -------------------------------------------------------

@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    energy_joules: float | None  # None where the board has no power rails
    ttft_s: float | None
    decode_tok_s: float | None
    duration_s: float


@dataclass(frozen=True)
class Delta:
    text: str
    # the tokens whose text this delta completes (when the request asked for logprobs); a token whose
    # text is held back (a partial character, a possible stop string) comes with the next delta
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length", "cancelled", "error", "shutdown" (ended by the service's stop),
    # "unavailable" (a transient failure of something the step needs, e.g. the edge server: retry later)
    usage: Usage
    message: str = ""
    token_ids: tuple[int, ...] = ()  # the completion's tokens (EOS not included)


@dataclass(frozen=True)
class RequestOutput:
    """One event of one request, as `EngineCore.step()` returns them."""

    req_id: str
    event: Delta | Finished


# -- what the engine is handed ---------------------------------------------------------------------

class Executor(Protocol):
    """Runs a step on the model (agent.engine.executor.ChainExecutor, or a stand-in in tests)."""

    @property
    def max_batch(self) -> int: ...
    @property
    def max_seq(self) -> int: ...
    def execute(self, plan: StepPlan) -> StepOutput: ...


class EnergyMeter(Protocol):
    """Joules a step drew (power.runtime.meter.BoardMeter: from its last sample, never a file read);
    `available` is False without power rails."""

    @property
    def available(self) -> bool: ...
    def step_joules(self, elapsed_s: float) -> float | None: ...


class EngineMetrics(Protocol):
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_token(self, latency_s: float) -> None: ...
    def on_step(self, plan: StepPlan, elapsed_s: float, joules: float | None) -> None: ...
    def on_finished(self, reason: str, usage: Usage) -> None: ...
    def on_queue(self, waiting: int, running: int) -> None: ...
    def on_phase(self, kind: str) -> None: ...
    def on_depth(self, depth: DepthStats) -> None: ...


_ids = itertools.count()


def next_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{next(_ids):08d}"
