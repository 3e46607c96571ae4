"""Generation on a chain of slices: prefill and decode as separate steps, sampling (greedy,
temperature, top-k, top-p, repetition penalty, seed), stop strings, token and context limits, and a
stream of text deltas that are whole characters.

The steps are plain functions of (chain, ids, positions) so that the service's scheduler can drive
them one at a time; `Generation.stream()` is the single-request loop on top for the CLI and tests.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from partition.runners.chain import Chain
from partition.tokenizer import IncrementalDecoder, Tokenizer


class GenerationError(ValueError):
    """Bad generation input (prompt too long, bad sampling parameter); the message says what to do."""


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

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise GenerationError(message)


def make_rng(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: np.ndarray, params: SamplingParams, history: list[int], rng: torch.Generator) -> int:
    """Pick the next token from float32 logits (V,), in Hugging Face's order: repetition penalty,
    temperature, top-k, top-p, then a draw (or argmax when greedy)."""
    x = torch.from_numpy(np.array(logits, dtype=np.float32, copy=True))
    if params.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        vals = x[seen]
        # CTRL's penalty (arXiv 1909.05858): shrink positive logits, push negative ones further down.
        x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.temperature == 0:
        return int(torch.argmax(x))
    x = x / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= params.top_p  # keep the smallest set reaching top_p
        x[order[drop]] = -math.inf
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))


class StopMatcher:
    """Finds stop strings in streamed text and holds back a tail that might be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += delta
        if not self.stops:
            return self._emit(len(self.text)), False
        window = max(0, self.emitted - max(len(s) for s in self.stops))
        hits = [i for i in (self.text.find(s, window) for s in self.stops) if i >= 0]
        if hits:
            return self._emit(min(hits)), True
        hold = 0
        for s in self.stops:  # longest suffix of the text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._emit(len(self.text) - hold), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first one (the first comes out of prefill)."""
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "prefill_ms": round(self.prefill_ms, 3), "decode_tok_s": round(self.decode_tok_s, 3),
                "finish_reason": self.finish_reason}


def prefill(chain: Chain, ids: list[int], slot: int = 0) -> np.ndarray:
    """Run the prompt through every slice; returns the next-token logits (V,)."""
    tokens = np.asarray([ids], dtype=np.int32)  # (1, T)
    positions = np.arange(len(ids), dtype=np.int32)[None]  # (1, T)
    return chain.forward(tokens, positions, [slot])[0]


def decode_step(chain: Chain, token: int, position: int, slot: int = 0) -> np.ndarray:
    """One token through every slice at `position`; returns the next-token logits (V,)."""
    return chain.forward(np.asarray([[token]], dtype=np.int32), np.asarray([[position]], dtype=np.int32),
                         [slot])[0]


class Generation:
    """One request on a chain: `stream()` yields text deltas; `stats` is filled as it goes."""

    def __init__(self, chain: Chain, tokenizer: Tokenizer, prompt: str | list[int],
                 params: SamplingParams) -> None:
        self.chain, self.tokenizer, self.params = chain, tokenizer, params
        self.prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not self.prompt_ids:
            raise GenerationError("the prompt is empty: give at least one token of text")
        if len(self.prompt_ids) >= chain.max_seq:
            raise GenerationError(
                f"the prompt is {len(self.prompt_ids)} tokens but the context holds {chain.max_seq}; "
                "shorten the prompt or raise --max-seq (up to the model's max_position_embeddings)")
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))

    def stream(self) -> Iterator[str]:
        p, stats = self.params, self.stats
        rng = make_rng(p.seed)
        detok = IncrementalDecoder(self.tokenizer)
        stops = StopMatcher(p.stop)
        budget = min(p.max_tokens, self.chain.max_seq - len(self.prompt_ids))
        history = list(self.prompt_ids)
        hit = False
        t0 = time.perf_counter()
        logits = prefill(self.chain, self.prompt_ids)
        token = sample(logits, p, history, rng)
        stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        while True:
            if token in self.tokenizer.eos_ids and not p.ignore_eos:
                stats.finish_reason = "stop"
                break
            stats.token_ids.append(token)
            stats.completion_tokens += 1
            history.append(token)
            text, hit = stops.feed(detok.push(token))
            if text:
                yield text
            if hit:
                stats.finish_reason = "stop"
                break
            if stats.completion_tokens >= budget:
                stats.finish_reason = "length"
                break
            logits = decode_step(self.chain, token, len(history) - 1)
            token = sample(logits, p, history, rng)
        stats.decode_s = time.perf_counter() - t1
        if not hit:  # after a stop string, what was held back is the stop string itself
            tail, _ = stops.feed(detok.flush())
            tail += stops.flush()
            if tail:
                yield tail
