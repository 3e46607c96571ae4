"""kernels/rope_triton.py against partition.model's torch formulation of a decode step's RoPE and cache write:
q rotated, K rotated and V copied into the cache at each row's slot, every other slot untouched, for batch 1 and
3, bf16 and fp32, a strided q/k/v (the split of a fused qkv projection's output). Without a GPU the kernel runs
in Triton's CPU interpreter (a fresh process, skipped where Triton is not installed); on CUDA it also runs
inside the compiled model's decode step (tests/test_cuda_quant.py, tests/test_cuda_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from tests.test_kv_triton import HAS_TRITON, run_in_interpreter


def check_rope_write(device: str) -> None:
    from kernels.rope_triton import rope_write
    from partition.model import _rotate_half, rope_cos_sin

    h, kv, hd, length = 8, 2, 64, 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    for b, dtype in ((1, torch.bfloat16), (3, torch.float32)):
        g = torch.Generator().manual_seed(b)
        qkv = torch.randn(b, 1, (h + 2 * kv) * hd, generator=g).to(device=device, dtype=dtype)
        qx, kx, vx = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)  # strided views, as a fused projection gives
        kc = torch.randn(b, kv, length, hd, generator=g).to(device=device, dtype=dtype)
        vc = torch.randn(b, kv, length, hd, generator=g).to(device=device, dtype=dtype)
        pos = torch.tensor([5, 39, 0][:b], device=device)
        cos, sin = rope_cos_sin(inv_freq.to(device), pos[:, None].to(torch.int32), dtype)  # (B, 1, 1, hd)
        want_kc, want_vc = kc.clone(), vc.clone()
        q = qx.view(b, 1, h, hd).transpose(1, 2).float()
        k = kx.view(b, 1, kv, hd).transpose(1, 2).float()
        want_q = (q * cos.float() + _rotate_half(q) * sin.float()).to(dtype)[:, :, 0]  # (B, H, hd)
        k_rot = (k * cos.float() + _rotate_half(k) * sin.float()).to(dtype)
        for r in range(b):
            want_kc[r, :, int(pos[r])] = k_rot[r, :, 0]
            want_vc[r, :, int(pos[r])] = vx.view(b, kv, hd)[r]
        got_q = rope_write(qx.reshape(b, -1), kx.reshape(b, -1), vx.reshape(b, -1), cos[:, 0, 0], sin[:, 0, 0], pos,
                           kc, vc)
        assert got_q.shape == (b, h, hd) and got_q.dtype == dtype
        tol = 0 if dtype == torch.float32 else 2 ** -7  # one rounding of the same fp32 value; bf16 rounding modes
        assert torch.allclose(got_q.float(), want_q.float(), rtol=tol, atol=1e-6), (b, dtype)
        assert torch.allclose(kc.float(), want_kc.float(), rtol=tol, atol=1e-6), (b, dtype)
        assert torch.equal(vc, want_vc), (b, dtype)  # V copied bit for bit, every other slot untouched
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rope_write(qx.reshape(b, -1), kx.reshape(b, -1), vx.reshape(b, -1), cos[:, 0, 0], sin[:, 0, 0], pos,
                   kc.transpose(2, 3), vc)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
def test_rope_write_in_triton_interpreter() -> None:
    run_in_interpreter("from tests.test_rope_triton import check_rope_write; check_rope_write('cpu')", timeout=300)


@pytest.mark.cuda
def test_rope_write_cuda() -> None:
    check_rope_write("cuda")
