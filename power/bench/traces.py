"""Synthetic request traces for the energy benchmark: arrival times, prompt and output lengths,
seeded so every policy in a run (and every run with the same seed) sees the same requests.

The traces of the energy benchmark. The shapes are estimates in the spirit of public chat and
RAG logs, not fits to a data set (stated in docs/BENCHMARKS.md):
- ``chat``: one user at an edge box. Poisson arrivals (mean gap 20 s: reading and typing between
  turns), prompts with multi-turn history (log-normal, median 400 tokens), answers log-normal with
  median 180 tokens (LMSYS-Chat-1M reports ~215 tokens per answer on average, arXiv 2309.11998).
- ``rag``: retrieved context makes prompts long (median 2000 tokens), answers short (median 150),
  mean gap 30 s.
- ``sparse``: an assistant that is mostly idle: one request a minute on average (chat-sized), so
  idle power dominates the energy.
- ``batch``: offline jobs, sustained: arrivals faster than the board serves them (mean gap 0.5 s),
  prompts median 1000, answers median 250: the queue never drains, the board never rests.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: int
    output: int


@dataclass(frozen=True)
class TraceShape:
    name: str
    mean_gap_s: float
    prompt_median: int
    prompt_sigma: float
    out_median: int
    out_sigma: float
    max_prompt: int = 4096
    max_output: int = 1024


TRACES = {
    "chat": TraceShape("chat", 20.0, 400, 0.8, 180, 0.7),
    "rag": TraceShape("rag", 30.0, 2000, 0.4, 150, 0.5),
    "batch": TraceShape("batch", 0.5, 1000, 0.5, 250, 0.5),
    "sparse": TraceShape("sparse", 60.0, 400, 0.8, 180, 0.7),
}


def make_trace(name: str, duration_s: float, seed: int = 0) -> tuple[Request, ...]:
    """Requests arriving within ``duration_s`` seconds of virtual time."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; allowed: {', '.join(TRACES)}")
    if duration_s <= 0:
        raise ValueError(f"trace duration must be positive, got {duration_s}")
    shape = TRACES[name]
    rng = random.Random(f"{name}:{seed}")
    out: list[Request] = []
    t = rng.expovariate(1 / shape.mean_gap_s) if name != "batch" else 0.0
    while t < duration_s:
        p = int(min(shape.max_prompt, max(16, rng.lognormvariate(math.log(shape.prompt_median), shape.prompt_sigma))))
        o = int(min(shape.max_output, max(8, rng.lognormvariate(math.log(shape.out_median), shape.out_sigma))))
        out.append(Request(round(t, 6), p, o))
        t += rng.expovariate(1 / shape.mean_gap_s)
    return tuple(out)
