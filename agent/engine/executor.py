"""The executor: a `StepPlan` in, sampled tokens out (`StepOutput`), on a chain of slice runners.

Owns what the scheduler must not touch: the chain (and through it the KV-cache), the arrays, and
each request's sampler (its RNG and the token history the repetition penalty needs), with the
sampling itself (greedy, temperature, top-k, top-p, repetition penalty, seed) in torch. A request's
first chunk carries its `SamplingParams`; `plan.released` names the requests gone since the last step.
`load_core` puts an `EngineCore` on a checkpoint's chain (what `orin-agent generate` steps).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agent.engine.core import EngineCore
from agent.engine.types import SamplingParams, StepOutput, StepPlan
from partition.runners.chain import Chain
from partition.tokenizer import Tokenizer


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
                self.samplers[c.req_id] = _Sampler(c.sampling, make_rng(c.sampling.seed))
            elif c.req_id not in self.samplers:
                raise KeyError(f"request {c.req_id}: a later chunk came before its first (no sampling params)")
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


def load_core(model: Path, backend: str = "torch", slices: str | None = None, max_seq: int | None = None,
              device: str = "cpu", cuda_graphs: bool | None = None, chain: Chain | None = None) -> EngineCore:
    """An `EngineCore` on one cache row of a checkpoint's chain (or on ``chain``, e.g. one whose deep
    slice is an edge server): single requests, stepped directly."""
    from partition.runners import load_chain

    tokenizer = Tokenizer.from_dir(model)
    if chain is None:
        chain = load_chain(model, backend=backend, slices=slices, max_seq=max_seq, device=device,
                           cuda_graphs=cuda_graphs)
    return EngineCore(ChainExecutor(chain), tokenizer)
