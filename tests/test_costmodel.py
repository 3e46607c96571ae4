"""The roofline cost model against the published anchors in ../shared/ORIN.md, plus sanity."""
from __future__ import annotations

import pytest

from power.physics.boards import board_for
from power.physics.costmodel import OperatingPoint, bandwidth_ceiling_tokens_per_s, decode_step, decode_tokens_per_s, prefill_step
from power.runtime.shapes import model_shape

AGX = board_for("agx-orin-64gb", "r36")
MAXN = OperatingPoint.of_mode(AGX, 0)
L3 = model_shape("llama-3-8b")


def within(value: float, anchor: float, tol: float = 0.25) -> bool:
    return abs(value - anchor) <= tol * anchor


def test_agx_int4_decode_anchor() -> None:
    """TensorRT-LLM 0.12, MAXN, Llama-3-8B INT4 weight-only: 35.9 tok/s."""
    tps = decode_tokens_per_s(AGX, L3, "int4", MAXN, context=512)
    assert within(tps, 35.9), tps
    assert decode_step(AGX, L3, "int4", MAXN, 512).bound == "memory"


def test_agx_fp16_ceiling_anchor() -> None:
    """204.8 GB/s over 16 GB of FP16 weights: about 12.8 tok/s, and no runtime beats the ceiling."""
    ceiling = bandwidth_ceiling_tokens_per_s(AGX, L3, "fp16")
    assert within(ceiling, 12.8), ceiling
    assert decode_tokens_per_s(AGX, L3, "fp16", MAXN) < ceiling
    assert within(bandwidth_ceiling_tokens_per_s(AGX, L3, "int4"), 45.0)


@pytest.mark.parametrize("tokens, ms", [(128, 91.0), (1024, 582.0)])
def test_agx_int4_prefill_anchor(tokens: int, ms: float) -> None:
    """TensorRT-LLM 0.12 prefill: 91 ms for 128 tokens, 582 ms for 1024."""
    step = prefill_step(AGX, L3, "int4", MAXN, tokens)
    assert within(step.seconds * 1000, ms), step.seconds
    assert step.bound == "compute"


@pytest.mark.parametrize("shape, original, super_", [("llama-3-8b", 14.0, 19.1),  # Llama-3.1-8B: Llama-3-8B's shape
                                                     ("llama-3.2-3b", 27.7, 43.1)])
@pytest.mark.parametrize("precision", ["q4f16", "int4"])
def test_orin_nano_super_anchors(shape: str, original: float, super_: float, precision: str) -> None:
    """jetson-generative-ai-playground: Orin Nano original -> Super, 4-bit (MLC q4f16)."""
    m = model_shape(shape)
    nano, nano_super = board_for("orin-nano-8gb", "r35"), board_for("orin-nano-8gb", "r36")
    a = decode_tokens_per_s(nano, m, precision, OperatingPoint.of_mode(nano, 0))
    b = decode_tokens_per_s(nano_super, m, precision, OperatingPoint.of_mode(nano_super, 2))
    assert within(a, original), a
    assert within(b, super_), b


def test_decode_follows_emc_not_gpu_clock() -> None:
    emc = [decode_step(AGX, L3, "int4", OperatingPoint(AGX.gpu_max_hz, e, 8), 512).seconds
           for e in AGX.emc_hz]
    assert emc == sorted(emc, reverse=True) and emc[-2] / emc[-1] > 1.3
    gpu = [decode_step(AGX, L3, "int4", OperatingPoint(g, AGX.emc_max_hz, 8), 512).seconds
           for g in (828750000, 1032750000, 1300500000)]
    assert gpu == sorted(gpu, reverse=True) and gpu[0] / gpu[-1] < 1.1


def test_prefill_follows_gpu_clock_not_emc() -> None:
    gpu = [prefill_step(AGX, L3, "int4", OperatingPoint(g, AGX.emc_max_hz, 8), 512).seconds
           for g in (624750000, 1300500000)]
    assert gpu[0] / gpu[1] > 1.8
    emc = [prefill_step(AGX, L3, "int4", OperatingPoint(AGX.gpu_max_hz, e, 8), 512).seconds
           for e in (2133000000, 3199000000)]
    assert emc[0] / emc[1] < 1.05


def test_kv_cache_and_tpcs_matter() -> None:
    short = decode_step(AGX, L3, "fp16", MAXN, 128).seconds
    long = decode_step(AGX, L3, "fp16", MAXN, 8192).seconds
    assert long > short * 1.05
    four = prefill_step(AGX, L3, "int4", OperatingPoint(AGX.gpu_max_hz, AGX.emc_max_hz, 4), 512)
    assert four.seconds > 1.8 * prefill_step(AGX, L3, "int4", MAXN, 512).seconds


def test_energy_from_the_twin_power_model() -> None:
    d = decode_step(AGX, L3, "fp16", MAXN, 512)
    assert 20.0 <= d.power_w <= 30.0      # EdgeReasoning: 22-27 W board power, 8B FP16 decode
    assert d.energy_j == pytest.approx(d.power_w * d.seconds)
    p = prefill_step(AGX, L3, "int4", MAXN, 1024)
    assert p.power_w > d.power_w and p.power_w < AGX.power.module_cap_w
    # a lower power mode (50W) costs fewer joules per decoded token than MAXN
    low = decode_step(AGX, L3, "int4", OperatingPoint.of_mode(AGX, 3), 512)
    assert low.joules_per_token < decode_step(AGX, L3, "int4", MAXN, 512).joules_per_token


def test_workload_for_the_twin() -> None:
    d = decode_step(AGX, L3, "int4", MAXN, 512)
    w = d.workload(AGX, MAXN)
    assert w.phase == "decode" and w.gpu_util == 1.0 and 0.5 < w.mem_util <= 1.0


def test_unknown_shape_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama-3-8b"):
        model_shape("gpt-5")


def test_int4_formats_differ_by_their_lm_head() -> None:
    """TensorRT-LLM's AWQ int4 keeps the head FP16; MLC's q4f16_1 and llama.cpp's Q4_K_M quantise it: for a
    small model with a 128k vocabulary the head is about half the bytes of a decode step at int4."""
    from power.physics.costmodel import PRECISIONS, _weight_bytes
    one_b = model_shape("llama-3.2-1b")
    head_int4 = one_b.head_params * PRECISIONS["int4"].head_bytes
    assert 0.45 < head_int4 / _weight_bytes(one_b, PRECISIONS["int4"]) < 0.55
    assert _weight_bytes(one_b, PRECISIONS["q4f16_1"]) < 0.7 * _weight_bytes(one_b, PRECISIONS["int4"])   # a third less
    # llama.cpp's README: Llama-3.1-8B Q4_K_M is 4.58 GiB; a step reads all of it but the embedding (Q4_K)
    eight = model_shape("llama-3-8b")
    file_bytes = _weight_bytes(eight, PRECISIONS["q4_k_m"]) + eight.head_params * 4.5 / 8
    assert within(file_bytes / 2 ** 30, 4.58, 0.02)


def test_runtime_profiles_and_their_errors() -> None:
    from power.physics.predict import PointQuery, predict_point
    q = dict(board="orin-nano-8gb", l4t="r36", precision="q4f16_1", tokens=256)
    mlc = predict_point(PointQuery(model_shape("llama-3.2-1b"), runtime="mlc", **q))
    trt = predict_point(PointQuery(model_shape("llama-3.2-1b"), runtime="tensorrt-llm", **q))
    assert mlc.step_ms > trt.step_ms and mlc.runtime == "mlc"      # MLC's fitted per-step overhead is larger
    with pytest.raises(ValueError, match="unknown runtime 'vllm'; allowed: tensorrt-llm, mlc, llama.cpp"):
        predict_point(PointQuery(model_shape("llama-3-8b"), runtime="vllm"))
