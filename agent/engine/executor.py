"""The executor: a `StepPlan` in, sampled tokens out (`StepOutput`), on a chain of slice runners.

Owns what the scheduler must not touch: the chain (and through it the KV-cache), the arrays, and
each request's sampler (its RNG and the token history the repetition penalty needs), with the
sampling itself (greedy, temperature, top-k, top-p, repetition penalty, seed) in torch. A request's
first chunk carries its `SamplingParams`; `plan.released` names the requests gone since the last step.
`load_core` puts an `EngineCore` on a checkpoint's chain (what `orin-agent generate` steps); on a
paged chain (`kv_blocks`) with the block-counting `PagedScheduler`, whose chunks carry block tables.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from agent.engine.core import EngineCore
from agent.engine.types import SamplingParams, SeqChunk, StepOutput, StepPlan, TokenLogprob
from partition.runners.chain import Chain
from partition.tokenizer import Tokenizer

if TYPE_CHECKING:
    from agent.engine.paged_scheduler import PagedScheduler


def make_rng(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int],
           rng: torch.Generator) -> int:
    """Pick the next token from float32 logits (V,), in Hugging Face's order: repetition penalty,
    logit bias (OpenAI's, added to the logits), temperature, top-k, top-p, then a draw (or argmax when
    greedy)."""
    return sample_with_logprob(logits, params, history, rng)[0]


def sample_with_logprob(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int],
                        rng: torch.Generator) -> tuple[int, TokenLogprob | None]:
    """`sample`, and the token's `TokenLogprob` when `params.logprobs` is set (else None)."""
    x = warp(logits, params, history)
    if params.temperature == 0:
        token = int(torch.argmax(x))
    else:
        token = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=rng))
    return token, None if params.logprobs is None else token_logprob(x, token, params.logprobs)


def token_logprob(warped: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The log-probability of `token` and the `k` most likely tokens under the distribution it was
    drawn from: the log-softmax of the warped logits, i.e. after repetition penalty, logit bias and,
    when sampling, temperature, top-k and top-p (greedy: no temperature). OpenAI documents its
    logprobs as the model's; we report what the sampler actually used, so greedy's top-1 is the
    emitted token even under logit_bias. Tokens masked out by top-k/top-p (-inf) are not listed, so
    `top` may hold fewer than k entries."""
    lp = torch.log_softmax(warped, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids, vals) if math.isfinite(float(v)))
    return TokenLogprob(token, float(lp[token]), top)


def warp(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The logits `sample` draws from (a fresh float32 tensor): penalty, logit bias, then, unless greedy,
    temperature, top-k and top-p (masked to -inf). Speculative acceptance compares these."""
    x = logits.detach().float().clone().cpu() if torch.is_tensor(logits) else \
        torch.from_numpy(np.array(logits, dtype=np.float32, copy=True))
    if params.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        vals = x[seen]
        # CTRL's penalty (arXiv 1909.05858): shrink positive logits, push negative ones further down.
        x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        x[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    if params.temperature == 0:
        return x
    x = x / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= params.top_p  # keep the smallest set reaching top_p
        x[order[drop]] = -math.inf
    return x


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
        self._start(plan)
        tokens, logprobs = self._forward(plan.chunks)
        return StepOutput(tokens, time.perf_counter() - t0, logprobs=logprobs)

    def _start(self, plan: StepPlan) -> None:
        """Drop released requests' samplers; make new requests' ones."""
        for rid in plan.released:
            self.samplers.pop(rid, None)
        for c in plan.chunks:
            if c.sampling is not None:
                self.samplers[c.req_id] = _Sampler(c.sampling, make_rng(c.sampling.seed))
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


def load_core(model: Path, backend: str = "torch", slices: str | None = None, max_seq: int | None = None,
              device: str = "cpu", cuda_graphs: bool | None = None, chain: Chain | None = None,
              exits: bool = False, kv_cache: str = "fp16", kv_blocks: int | None = None,
              block_size: int = 16) -> EngineCore:
    """An `EngineCore` on one cache row of a checkpoint's chain (or on ``chain``, e.g. one whose deep
    slice is an edge server): single requests, stepped directly. exits: cut the chain at the model's
    exit heads (agent.engine.speculative), for requests that speculate or exit early."""
    from partition.runners import load_chain

    tokenizer = Tokenizer.from_dir(model)
    if exits:
        if kv_cache != "fp16" or kv_blocks is not None:
            raise ValueError("early exit and speculation run on the dense fp16 cache: drop --kv-cache int8")
        from agent.engine.speculative import exit_executor_on, load_exit_executor

        if chain is not None:
            return EngineCore(exit_executor_on(chain, model, device), tokenizer)

        return EngineCore(load_exit_executor(model, backend, slices, max_seq, device), tokenizer)
    if chain is None:
        chain = load_chain(model, backend=backend, slices=slices, max_seq=max_seq, device=device,
                           cuda_graphs=cuda_graphs, kv_cache=kv_cache, kv_blocks=kv_blocks, block_size=block_size)
    return EngineCore(ChainExecutor(chain), tokenizer, scheduler=paged_scheduler(chain, tokenizer))


def paged_scheduler(chain: Chain, tokenizer: Tokenizer) -> "PagedScheduler | None":
    """The block-counting scheduler a paged chain needs (None for a chain of per-row caches: the
    engine's default row scheduler). No queue bound: the caller bounds what it submits."""
    if chain.paging is None:
        return None
    from agent.engine.paged_scheduler import PagedScheduler

    num_blocks, size = chain.paging
    return PagedScheduler(chain.max_batch, chain.max_seq, num_blocks, size, tokenizer.eos_ids, max_queue=1 << 30)
