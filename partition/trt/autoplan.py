"""Automatic per-layer precision: measure how much quantising one decoder layer's weights raises the
perplexity of the model on a calibration set (every other layer left alone), then choose the cheapest
plan whose summed increase stays within a budget, and measure the chosen plan as a whole.

The weight-only quantiser is injected (`LayerQuantizer`: a context manager that swaps one layer's
weights for their quantised values and puts them back); partition.trt.autoquant supplies the one built
on partition.quantize's round-to-nearest and runs the whole `--precision auto`. Summing per-layer increases assumes they add up, the usual first-order
assumption of sensitivity-based mixed precision; `measure_plan` checks the chosen plan for real.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from partition.config import ModelConfig
from partition.model import Transformer
from partition.trt.precision import PrecisionPlan

LayerQuantizer = Callable[[nn.Module, str], ContextManager[None]]
WEIGHT_BITS = {"fp32": 32, "fp16": 16, "int8-wo": 8, "int4-wo": 4}


@dataclass(frozen=True)
class Sensitivity:
    layer: int
    precision: str
    increase: float  # relative perplexity increase with only this layer at this precision (0.01 = 1 %)


@dataclass(frozen=True)
class AutoPlan:
    plan: PrecisionPlan
    predicted_increase: float
    weight_bytes: int
    fp16_bytes: int


def layer_weight_bytes(config: ModelConfig, precision: str) -> int:
    """Bytes of one decoder layer's matrices at `precision` (norm weights and scales left out)."""
    d, kv = config.hidden_size, config.n_kv_heads * config.head_dim
    params = d * config.n_heads * config.head_dim * 2 + d * kv * 2 + 3 * d * config.intermediate_size
    return params * WEIGHT_BITS[precision] // 8


@torch.no_grad()
def perplexity(model: Transformer, ids: torch.Tensor) -> float:
    """Perplexity of rows `ids` (B, T + 1): predict tokens 1..T from 0..T-1 (no cache)."""
    cfg = model.config
    b, t = ids.shape[0], ids.shape[1] - 1
    past = [torch.zeros(b, cfg.n_kv_heads, 0, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    pos = torch.arange(t, dtype=torch.int32).expand(b, t)
    logits = model.slice(0, cfg.n_layers, all_logits=True)(ids[:, :-1].int(), pos, *past)[0]
    return math.exp(F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), ids[:, 1:].reshape(-1).long()).item())


def measure_sensitivities(model: Transformer, ids: torch.Tensor, precisions: Sequence[str],
                          quantize: LayerQuantizer) -> list[Sensitivity]:
    base = perplexity(model, ids)
    out = []
    for i, layer in enumerate(model.model.layers):
        for p in precisions:
            with quantize(layer, p):
                out.append(Sensitivity(i, p, perplexity(model, ids) / base - 1))
    return out


def choose_plan(sens: Sequence[Sensitivity], config: ModelConfig, budget: float) -> AutoPlan:
    """Greedy multiple-choice knapsack: start with every layer fp16, repeatedly take the move (one
    layer to a smaller precision) that saves the most bytes per unit of added increase, while the
    summed increase stays within `budget`."""
    cost = {(s.layer, s.precision): max(0.0, s.increase) for s in sens}
    size = {p: layer_weight_bytes(config, p) for p in WEIGHT_BITS}
    current = {i: "fp16" for i in range(config.n_layers)}
    spent = 0.0
    while True:
        best: tuple[float, int, str, float] | None = None
        for (layer, p), c in cost.items():
            saved = size[current[layer]] - size[p]
            extra = c - cost.get((layer, current[layer]), 0.0)
            if saved <= 0 or spent + extra > budget:
                continue
            ratio = math.inf if extra <= 0 else saved / extra
            if best is None or ratio > best[0]:
                best = (ratio, layer, p, extra)
        if best is None:
            break
        _, layer, p, extra = best
        current[layer], spent = p, spent + extra
    plan = PrecisionPlan("fp16", tuple((i, p) for i, p in sorted(current.items()) if p != "fp16"))
    return AutoPlan(plan, spent, sum(size[p] for p in current.values()), size["fp16"] * config.n_layers)


def measure_plan(model: Transformer, ids: torch.Tensor, plan: PrecisionPlan, quantize: LayerQuantizer) -> float:
    """The measured relative perplexity increase of the whole plan (every override applied at once)."""
    base = perplexity(model, ids)
    with contextlib.ExitStack() as stack:
        for i, p in plan.layers:
            stack.enter_context(quantize(model.model.layers[i], p))
        return perplexity(model, ids) / base - 1
