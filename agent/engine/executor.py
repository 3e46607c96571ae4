"""The runner side of the step contract: a `StepPlan` in, sampled tokens out (`StepOutput`).

Owns what the scheduler must not touch: the chain of slice runners (and through it the KV-cache),
the arrays, and each request's sampler (its RNG and the token history the repetition penalty needs).
The scheduler tells it about a new request by attaching `SamplingParams` to the request's first
chunk, and about a finished one through `plan.released`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from agent.generation import SamplingParams, make_rng, sample
from agent.scheduler import StepOutput, StepPlan
from partition.runners.chain import Chain


@dataclass
class _Sampler:
    params: SamplingParams
    rng: torch.Generator
    history: list[int] = field(default_factory=list)  # every token fed so far (prompt + output)


class ChainExecutor:
    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.samplers: dict[str, _Sampler] = {}

    @property
    def max_batch(self) -> int:
        return self.chain.max_batch

    @property
    def max_seq(self) -> int:
        return self.chain.max_seq

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        for rid in plan.released:
            self.samplers.pop(rid, None)
        for c in plan.chunks:
            if c.sampling is not None:
                params = c.sampling if isinstance(c.sampling, SamplingParams) else SamplingParams()
                self.samplers[c.req_id] = _Sampler(params, make_rng(params.seed))
        t = len(plan.chunks[0].token_ids)
        tokens = np.asarray([c.token_ids for c in plan.chunks], dtype=np.int32)  # (B, T)
        positions = np.asarray([c.start_pos for c in plan.chunks], dtype=np.int32)[:, None] + \
            np.arange(t, dtype=np.int32)[None]  # (B, T)
        logits = self.chain.forward(tokens, positions, [c.slot for c in plan.chunks])  # (B, V)
        out: dict[str, int] = {}
        for i, c in enumerate(plan.chunks):
            s = self.samplers[c.req_id]
            s.history.extend(c.token_ids)
            if c.sample:
                out[c.req_id] = sample(logits[i], s.params, s.history, s.rng)
        return StepOutput(out, time.perf_counter() - t0)
