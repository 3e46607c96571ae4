"""GGUF block formats as the project's weight-only layout: QuantLinear's float-min form (Q4_1 / Q4_K:
weight = q * s + m per 32-group) through the INT4 kernel and the reference path, and each GGUF block
type unpacked by partition/gguf/quants.py to exactly what the gguf package dequantises."""
from __future__ import annotations

import pytest
import torch

from kernels.weight_only import QuantLinear


def _min_form(n: int = 64, k: int = 256, g: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3
    m = -torch.rand(n, k // g, generator=gen) * 0.08
    g_idx = torch.arange(k) // g
    return q, s, m, g_idx, q.float() * s[:, g_idx] + m[:, g_idx]


@pytest.mark.parametrize("reference", [False, True])
def test_gguf_float_min_quant_linear_matches_its_weight(reference: bool) -> None:
    q, s, m, g_idx, w = _min_form()
    lin = QuantLinear(q, s, None, g_idx, 4, 32, mins=m, reference=reference)
    assert lin.kernel == ("reference" if reference else "int4pack_cpu")
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), x @ w.T, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lin.dequantized_weight(), w, atol=1e-6, rtol=1e-6)


def test_cpu_int4_rows_of_a_prefill_go_through_the_nibbles_with_the_kernels_numbers(monkeypatch) -> None:
    """fp32 on the CPU: one row through aten's int4pack op, CPU_DEQUANT_ROWS rows and more through the nibbles
    dequantised once (the op dequantises the weight for every row); both the layer's own weight, in both forms
    (float minimums, integer zero points); the nibbles are no part of the state dict, and bf16 layers keep none."""
    from kernels import weight_only

    q, s, m, g_idx, w = _min_form(n=96, k=128)
    z = torch.randint(0, 16, s.shape, generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    wz = (q.float() - z.float()[:, g_idx]) * s[:, g_idx]
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    calls = []
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                        lambda *a: calls.append(a[0].shape[0]) or op(*a), raising=False)
    for lin, want in ((QuantLinear(q, s, None, g_idx, 4, 32, mins=m), w), (QuantLinear(q, s, z, g_idx, 4, 32), wz)):
        assert lin.kernel == "int4pack_cpu" and lin.nibbles.shape == (96, 64) and "nibbles" not in lin.state_dict()
        calls.clear()
        for rows in (1, weight_only.CPU_DEQUANT_ROWS, 37):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(lin(x), x @ want.T, atol=2e-5, rtol=1e-5)
        assert calls == [1]  # the op saw the one-row call only
        torch.testing.assert_close(lin.dequantized_weight(), want, atol=1e-6, rtol=1e-6)
    assert QuantLinear(q, s, None, g_idx, 4, 32, mins=m, dtype=torch.bfloat16).nibbles is None


def test_cpu_reference_layers_multiply_in_chunks_as_the_whole_weight_would(monkeypatch) -> None:
    """A reference layer on the CPU (Q8_0 groups, say) dequantises REFERENCE_CHUNK weights at a time: the same
    numbers as `dequantize` on the whole weight, zero points or minimums, with a bias, rows not a multiple of the
    chunk's, x of any leading shape; act-ordered groups keep the whole-weight path."""
    from kernels import weight_only
    from kernels.weight_only import dequantize

    monkeypatch.setattr(weight_only, "REFERENCE_CHUNK", 7 * 64)  # 7 rows a chunk of 100
    gen = torch.Generator().manual_seed(5)
    n, k, g = 100, 64, 32
    q = torch.randint(0, 256, (n, k), generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.01
    z = torch.randint(100, 156, (n, k // g), generator=gen, dtype=torch.int32)
    m = -torch.rand(n, k // g, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(2, 3, k, generator=gen)
    seq = torch.arange(k) // g
    for zeros, mins in ((z, None), (None, m)):
        lin = QuantLinear(q, s, zeros, seq, 8, g, bias=bias, mins=mins)
        assert lin.kernel == "reference" and lin.sequential
        want = x @ dequantize(q, s, zeros, seq, mins).T + bias
        torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)
    act_order = QuantLinear(q, s, z, seq.flip(0), 8, g)
    assert not act_order.sequential
    torch.testing.assert_close(act_order(x), x @ dequantize(q, s, z, seq.flip(0)).T, atol=1e-5, rtol=1e-5)


def test_gguf_float_min_quant_linear_takes_mins_or_zeros_not_both() -> None:
    q, s, m, g_idx, _ = _min_form()
    with pytest.raises(ValueError, match="either"):
        QuantLinear(q, s, torch.full_like(s, 8, dtype=torch.int32), g_idx, 4, 32, mins=m)
    with pytest.raises(ValueError, match="either"):
        QuantLinear(q, s, None, g_idx, 4, 32)
