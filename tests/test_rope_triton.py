"""kernels/rope_triton.py against partition.model's torch formulation of a decode step's and a prefill chunk's
RoPE and cache write: q rotated, K rotated and V copied into the cache at each token's slot, every other slot
untouched, for batch 1, 2 and 3, bf16 and fp32, a strided q/k/v (the split of a fused qkv projection's output);
and Attention's fused prefill against its torch formulation (output and caches). Without a GPU the kernel runs
in Triton's CPU interpreter (a fresh process, skipped where Triton is not installed); on CUDA it also runs
inside the compiled model's decode step (tests/test_cuda_quant.py, tests/test_cuda_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import HAS_TRITON, run_marked


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
    # a prefill chunk: T tokens a row at their own positions, q back in attention's (B, H, T, hd) layout
    t = 5
    for b, dtype in ((1, torch.bfloat16), (2, torch.float32)):
        g = torch.Generator().manual_seed(10 + b)
        qkv = torch.randn(b, t, (h + 2 * kv) * hd, generator=g).to(device=device, dtype=dtype)
        qx, kx, vx = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
        kc = torch.randn(b, kv, length, hd, generator=g).to(device=device, dtype=dtype)
        vc = torch.randn(b, kv, length, hd, generator=g).to(device=device, dtype=dtype)
        pos = (torch.tensor([0, 31][:b], device=device)[:, None] + torch.arange(t, device=device)).to(torch.int32)
        cos, sin = rope_cos_sin(inv_freq.to(device), pos, dtype)  # (B, 1, T, hd)
        q = qx.view(b, t, h, hd).transpose(1, 2).float()
        k = kx.view(b, t, kv, hd).transpose(1, 2).float()
        want_q = (q * cos.float() + _rotate_half(q) * sin.float()).to(dtype)  # (B, H, T, hd)
        k_rot = (k * cos.float() + _rotate_half(k) * sin.float()).to(dtype)
        want_kc, want_vc = kc.clone(), vc.clone()
        for r in range(b):
            want_kc[r, :, pos[r].long()] = k_rot[r]
            want_vc[r, :, pos[r].long()] = vx.view(b, t, kv, hd)[r].transpose(0, 1)
        got_q = rope_write(qx, kx, vx, cos[:, 0], sin[:, 0], pos, kc, vc)
        assert got_q.shape == (b, h, t, hd) and got_q.dtype == dtype and got_q.is_contiguous()
        tol = 0 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(got_q.float(), want_q.float(), rtol=tol, atol=1e-6), (b, dtype)
        assert torch.allclose(kc.float(), want_kc.float(), rtol=tol, atol=1e-6), (b, dtype)
        assert torch.equal(vc, want_vc), (b, dtype)


def check_prefill_attention(device: str) -> None:
    """Attention in in-place cache mode through the Triton kernels (RoPE + cache write, and a decode step's
    flash-decoding attention) against its torch formulation (ROPE_FUSED off): the same output and the same caches,
    for a prefill chunk that starts past slot 0, at another slot in each row, and for the decode step after it, GQA (4 query heads a KV head).
    On the CPU (Triton's interpreter) the kernels' CUDA gate is opened for the call."""
    import partition.model as pm
    from partition.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 128, 256, 1, 8, 2, 32, 512)
    torch.manual_seed(0)
    a = pm.Attention(cfg).to(device).requires_grad_(False)
    b, length = 2, 24
    start = torch.tensor([3, 9], device=device)[:, None]  # each row its own history
    inv_freq = 1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    group = cfg.n_heads // cfg.n_kv_heads
    caches = [torch.randn(b, cfg.n_kv_heads, length, cfg.head_dim, device=device) for _ in range(2)]
    ref_k, ref_v = (c.clone() for c in caches)
    for first, t in ((start, 6), (start + 6, 1)):
        x = torch.randn(b, t, cfg.hidden_size, device=device)
        positions = (first + torch.arange(t, device=device)).to(torch.int32)  # (B, T)
        cos, sin = pm.rope_cos_sin(inv_freq, positions, x.dtype)
        mask = pm.cache_mask(positions, length, x.dtype).repeat(1, 1, group, 1)
        slot = positions.long()[:, None, :, None].expand(b, cfg.n_kv_heads, t, cfg.head_dim)
        saved_fused, saved_gate = pm.ROPE_FUSED, pm._triton_decode_shapes
        pm.ROPE_FUSED = False
        try:
            want, _, _ = a(x, cos, sin, mask, ref_k, ref_v, slot)
            pm.ROPE_FUSED = True
            if device == "cpu":
                pm._triton_decode_shapes = lambda *args, **kw: True
            got, gk, gv = a(x, cos, sin, mask, caches[0], caches[1], slot)
        finally:
            pm.ROPE_FUSED, pm._triton_decode_shapes = saved_fused, saved_gate
        assert gk is caches[0] and gv is caches[1], t  # the caches, in place of the new K/V
        # a decode step's attention kernel takes fp16 dot operands (kernels.kv_triton; its own test: 3e-3)
        tol = 1e-5 if t > 1 else 3e-3
        assert torch.allclose(got, want, atol=tol), (t, float((got - want).abs().max()))
        assert torch.allclose(gk, ref_k, atol=1e-6) and torch.equal(gv, ref_v), t


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.interpreter("from tests.test_rope_triton import check_rope_write; check_rope_write('cpu')",
                         "from tests.test_rope_triton import check_prefill_attention; check_prefill_attention('cpu')",
                         timeout=300)
def test_rope_write_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run_marked(request)


@pytest.mark.cuda
def test_rope_write_cuda() -> None:
    check_rope_write("cuda")
    check_prefill_attention("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_rope_write_compiles_for_orin_and_hopper(arch: int) -> None:
    """The kernel compiles to SASS for sm_87 (Orin) and sm_90 without a GPU (scripts/kv_kernel_sass.py's
    compile), with no spills to the stack, at head_dim 64 and 128 in fp16 and bf16."""
    from kernels import rope_triton
    from scripts.kv_kernel_sass import compile_kernel, resources

    names = ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr", "qo_ptr")
    for dtype, hd in (("fp16", 64), ("bf16", 128)):
        types = {**{n: f"*{dtype}" for n in names}, "pos_ptr": "*i32"}
        k = compile_kernel(rope_triton._rope_write_kernel, types, {"H": 32, "HD": hd}, arch, warps=1, stages=1)
        assert k.asm["cubin"] and resources(k)["stack_bytes"] == 0
