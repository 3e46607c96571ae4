"""Automatic per-layer precision: the greedy knapsack respects the budget and prefers the cheapest
bytes, and the measurement loop finds the layer a quantiser hurts most (with a test-only rounding
quantiser standing in for partition.quantize, which is not in this tree)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from partition.checkpoint import random_model
from partition.config import ModelConfig
from partition.trt.autoplan import Sensitivity, choose_plan, layer_weight_bytes, measure_plan, measure_sensitivities

CFG = ModelConfig("LlamaForCausalLM", 320, 64, 4, 4, 2, 16, 128, max_position_embeddings=64)


def test_choose_plan_within_budget_cheapest_first() -> None:
    sens = [Sensitivity(0, "int8-wo", 0.001), Sensitivity(0, "int4-wo", 0.02),
            Sensitivity(1, "int8-wo", 0.004), Sensitivity(1, "int4-wo", 0.006),
            Sensitivity(2, "int8-wo", 0.05), Sensitivity(2, "int4-wo", 0.2),
            Sensitivity(3, "int8-wo", -0.001), Sensitivity(3, "int4-wo", 0.0)]
    auto = choose_plan(sens, CFG, budget=0.01)
    assert dict(auto.plan.layers) == {0: "int8-wo", 1: "int4-wo", 3: "int4-wo"}
    assert auto.predicted_increase <= 0.01
    fp16, i8, i4 = (layer_weight_bytes(CFG, p) for p in ("fp16", "int8-wo", "int4-wo"))
    assert auto.fp16_bytes == 4 * fp16 and auto.weight_bytes == i8 + i4 + fp16 + i4
    assert choose_plan(sens, CFG, budget=0.0).plan.layers == ((3, "int4-wo"),)  # only the free move


@contextlib.contextmanager
def _round_weights(layer: nn.Module, precision: str) -> Iterator[None]:
    """Test-only symmetric per-row rounding of a layer's Linear weights; restored on exit."""
    levels = {"int8-wo": 127, "int4-wo": 7}[precision]
    saved = {n: p.detach().clone() for n, p in layer.named_parameters() if p.dim() == 2}
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n in saved:
                scale = p.abs().amax(dim=1, keepdim=True) / levels
                p.copy_(torch.round(p / scale) * scale)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


def test_measurement_ranks_int4_above_int8_and_restores_weights() -> None:
    model = random_model(CFG, seed=2).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    before = [p.clone() for p in model.parameters()]
    sens = measure_sensitivities(model, ids, ["int8-wo", "int4-wo"], _round_weights)
    assert len(sens) == 2 * CFG.n_layers
    by = {(s.layer, s.precision): abs(s.increase) for s in sens}
    assert sum(by[(i, "int4-wo")] for i in range(4)) > sum(by[(i, "int8-wo")] for i in range(4))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    auto = choose_plan(sens, CFG, budget=0.05)
    measured = measure_plan(model, ids, auto.plan, _round_weights)
    assert abs(measured) < 0.2 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
