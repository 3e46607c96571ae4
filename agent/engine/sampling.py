"""Sampling: the next token from a row's logits, in Hugging Face's order (repetition penalty, logit bias,
temperature, top-k, top-p, then a draw, or argmax when greedy), its logprobs, and `Sampler`, the
per-request state a sampler keeps between steps (the parameters, the RNG, the token history the
repetition penalty reads). Torch on CPU; shared by the chain executor and the exit / speculative one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import numpy as np

from agent.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch


def make_rng(seed: int | None) -> torch.Generator:
    import torch

    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


@dataclass
class Sampler:
    """One request's sampling state, from its first chunk until it is released."""
    params: SamplingParams
    rng: torch.Generator | None  # None for a greedy request: it never draws
    history: list[int] = field(default_factory=list)  # every token fed so far (prompt + output)

    @classmethod
    def for_params(cls, params: SamplingParams) -> "Sampler":
        """A fresh sampler, its RNG seeded from `params.seed` (or from the OS when None); greedy requests get
        none (so a greedy generation on numpy runners never imports torch)."""
        return cls(params, make_rng(params.seed) if params.temperature != 0 else None)


def sample(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int],
           rng: torch.Generator) -> int:
    """Pick the next token from float32 logits (V,), in Hugging Face's order: repetition penalty,
    logit bias (OpenAI's, added to the logits), temperature, top-k, top-p, then a draw (or argmax when
    greedy)."""
    return sample_with_logprob(logits, params, history, rng)[0]


def sample_with_logprob(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int],
                        rng: torch.Generator) -> tuple[int, TokenLogprob | None]:
    """`sample`, and the token's `TokenLogprob` when `params.logprobs` is set (else None)."""
    if (params.temperature == 0 and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.logit_bias and isinstance(logits, np.ndarray)):
        return int(np.argmax(logits)), None  # plain greedy: nothing to warp (np.argmax = torch.argmax: first max)
    import torch

    x = warp(logits, params, history)
    if params.temperature == 0:
        token = int(torch.argmax(x))
    else:
        if rng is None:
            raise ValueError("sampling with a temperature needs the sampler's RNG (Sampler.for_params makes one)")
        token = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=rng))
    return token, None if params.logprobs is None else token_logprob(x, token, params.logprobs)


def token_logprob(warped: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The log-probability of `token` and the `k` most likely tokens under the distribution it was
    drawn from: the log-softmax of the warped logits, i.e. after repetition penalty, logit bias and,
    when sampling, temperature, top-k and top-p (greedy: no temperature). OpenAI documents its
    logprobs as the model's; we report what the sampler actually used, so greedy's top-1 is the
    emitted token even under logit_bias. Tokens masked out by top-k/top-p (-inf) are not listed, so
    `top` may hold fewer than k entries."""
    import torch

    lp = torch.log_softmax(warped, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids, vals) if math.isfinite(float(v)))
    return TokenLogprob(token, float(lp[token]), top)


def warp(logits: np.ndarray | torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The logits `sample` draws from (a fresh float32 tensor): penalty, logit bias, then, unless greedy,
    temperature, top-k and top-p (masked to -inf). Speculative acceptance compares these."""
    import torch

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
