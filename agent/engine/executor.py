"""The chain executor: a `StepPlan` in, sampled tokens out (`StepOutput`), on a chain of slice runners.

Owns what the scheduler must not touch: the chain (and through it the KV-cache), the arrays, and
each request's `Sampler` (its RNG and the token history the repetition penalty needs; the sampling
itself is agent.engine.sampling). A request's first chunk carries its `SamplingParams`;
`plan.released` names the requests gone since the last step. Loading a checkpoint into an engine
(`load_core`) is agent.model_load's.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from agent.engine.sampling import Sampler, sample_with_logprob
from agent.engine.types import SeqChunk, StepOutput, StepPlan, TokenLogprob
from partition.runners.chain import Chain


class ChainExecutor:
    """Runs each step's rows through the whole chain in one batch and samples the rows that ask."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.samplers: dict[str, Sampler] = {}

    @property
    def max_batch(self) -> int:
        return self.chain.max_batch

    @property
    def max_seq(self) -> int:
        return self.chain.max_seq

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        self._start(plan)
        tokens, logprobs = self._forward(plan.chunks)
        return StepOutput(tokens, time.perf_counter() - t0, logprobs=logprobs)

    def _start(self, plan: StepPlan) -> None:
        """Drop released requests' samplers; make new requests' ones."""
        for rid in plan.released:
            self.samplers.pop(rid, None)
        for c in plan.chunks:
            if c.sampling is not None:
                self.samplers[c.req_id] = Sampler.for_params(c.sampling)
            elif c.req_id not in self.samplers:
                raise KeyError(f"request {c.req_id}: a later chunk came before its first (no sampling params)")

    def _forward(self, chunks: Sequence[SeqChunk]) -> tuple[dict[str, int], dict[str, tuple[TokenLogprob, ...]]]:
        """Rows of equal length through the whole chain in one batch: their sampled tokens, and the
        logprobs of those that asked."""
        t = len(chunks[0].token_ids)
        tokens = np.asarray([c.token_ids for c in chunks], dtype=np.int32)  # (B, T)
        positions = np.asarray([c.start_pos for c in chunks], dtype=np.int32)[:, None] + \
            np.arange(t, dtype=np.int32)[None]  # (B, T)
        tables = [c.blocks for c in chunks] if chunks[0].blocks else None  # paged KV-cache
        logits = self.chain.forward(tokens, positions, [c.slot for c in chunks], tables)  # (B, V)
        out: dict[str, int] = {}
        lps: dict[str, tuple[TokenLogprob, ...]] = {}
        for i, c in enumerate(chunks):
            s = self.samplers[c.req_id]
            s.history.extend(c.token_ids)
            if c.sample:
                out[c.req_id], lp = sample_with_logprob(logits[i], s.params, s.history, s.rng)
                if lp is not None:
                    lps[c.req_id] = (lp,)
        return out, lps
