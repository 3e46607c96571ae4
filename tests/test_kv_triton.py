"""The Triton kernels of the INT8 KV-cache (kernels/kv_triton.py) against their PyTorch reference
(kernels/kv_quant.py): quantise-on-write bit for bit (up to a rounding tie), decode attention within
FP16-dot tolerance, INT8 and FP16 caches, ragged lengths, GQA, several sequence splits. The `cuda`
tests run the compiled kernels on a GPU (quick: small shapes); without one, the same checks run once
in Triton's CPU interpreter when Triton is installed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from kernels.kv_quant import attention_reference, quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_quantize_write(device: str) -> None:
    from kernels.kv_triton import quantize_write

    torch.manual_seed(0)
    for group in (32, 64):
        fresh = torch.randn(2, 2, 3, 64, device=device, dtype=torch.float16) * 3
        qc = torch.zeros(3, 2, 40, 64, dtype=torch.int8, device=device)
        sc = torch.zeros(3, 2, 40, 64 // group, dtype=torch.float16, device=device)
        quantize_write(fresh, qc, sc, torch.tensor([2, 0], device=device), torch.tensor([5, 9], device=device))
        rq, rs = quantize(fresh, group)
        for i, (row, start) in enumerate(((2, 5), (0, 9))):
            assert torch.equal(sc[row, :, start:start + 3], rs[i])
            diff = (qc[row, :, start:start + 3].int() - rq[i].int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01  # round-half ties only
        assert int(qc[1].abs().sum()) == 0 and int(qc[2, :, :5].abs().sum()) == 0  # nothing else written


def check_decode_attention(device: str) -> None:
    from kernels.kv_triton import decode_attention

    torch.manual_seed(1)
    b, h, kv, s, hd = 3, 6, 2, 300, 64
    q = torch.randn(b, h, hd, device=device)
    k, v = torch.randn(b, kv, s, hd, device=device), torch.randn(b, kv, s, hd, device=device)
    lengths = torch.tensor([300, 77, 1], device=device)
    for group in (32, 64):
        kq, ks = quantize(k, group)
        vq, vs = quantize(v, group)
        want = attention_reference(q, kq, ks, vq, vs, lengths)
        for splits, variant in ((1, {}), (4, {}), (4, {"dense_scales": False, "fast_cvt": False})):
            got = decode_attention(q, kq, vq, lengths, ks, vs, n_splits=splits, **variant)
            assert torch.allclose(got, want, atol=3e-3), float((got - want).abs().max())
    # FP16 cache through the same kernel, against plain softmax attention
    kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q, kk) / hd ** 0.5
    scores = scores.masked_fill(torch.arange(s, device=device)[None, None] >= lengths[:, None, None], float("-inf"))
    want = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), vv)
    got = decode_attention(q.half(), k.half(), v.half(), lengths, n_splits=3)
    assert torch.allclose(got, want, atol=3e-3), float((got - want).abs().max())


@pytest.mark.cuda
def test_quantize_write_cuda() -> None:
    check_quantize_write("cuda")


@pytest.mark.cuda
def test_decode_attention_cuda() -> None:
    check_decode_attention("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
def test_kernels_in_triton_interpreter() -> None:
    """The same checks on CPU through TRITON_INTERPRET=1 (read when the kernels are defined, hence a
    fresh interpreter)."""
    code = ("from tests.test_kv_triton import check_quantize_write, check_decode_attention; "
            "check_quantize_write('cpu'); check_decode_attention('cpu')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
