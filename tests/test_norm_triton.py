"""kernels/norm_triton.py against partition.model's eager formulation: RMSNorm, the residual add fused into it,
and SiLU(gate) * up, in fp32 / fp16 / bf16, one row and many, a hidden size that is not a power of two (SmolLM2's
576), an intermediate size over two column blocks; then a whole model (fused gate/up) with the kernels on against
off. Without a GPU the kernels run in Triton's CPU interpreter (a fresh process, skipped where Triton is not
installed); on CUDA the same checks run compiled."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_kv_triton import HAS_TRITON, run_in_interpreter


def _eager_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_kernels(device: str) -> None:
    from kernels.norm_triton import add_rms_norm, applies, rms_norm, silu_mul

    eps = 1e-5
    for dtype, shape in ((torch.float32, (1, 1, 576)), (torch.float16, (3, 7, 576)), (torch.bfloat16, (2, 5, 384))):
        g = torch.Generator().manual_seed(shape[1])
        x = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
        res = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(device=device, dtype=dtype)
        assert applies(x, w) and not applies(x, w.float() if dtype != torch.float32 else w.half())
        # a rounding to dtype apart at most (the mean's sum runs in another order; the interpreter may truncate bf16)
        tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -6}[dtype]
        want = _eager_norm(x, w, eps)
        got = rms_norm(x, w, eps)
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (dtype, (got - want).abs().max())
        normed, summed = add_rms_norm(x, res, w, eps)
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's fp32 -> bf16 cast is not ATen's rounding
            assert torch.allclose(summed.float(), (x + res).float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(summed, x + res), dtype  # the residual stream bit for bit
        want = _eager_norm(x + res, w, eps)
        assert torch.allclose(normed.float(), want.float(), rtol=tol, atol=tol), (dtype, (normed - want).abs().max())
        inter = 1536  # two column blocks of SILU_BLOCK
        gate_up = torch.randn((*shape[:-1], 2 * inter), generator=g).to(device=device, dtype=dtype) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = silu_mul(gate_up)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (dtype, (got - want).abs().max())
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, res[..., :-1], w, eps)
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(gate_up[..., :-1])


def check_traceable(device: str) -> None:
    """The three ops inside torch.compile(fullgraph=True) (aot_eager: their fake implementations and
    functionalisation, what the compiled decode step traces through) give what they give eagerly."""
    from kernels.norm_triton import add_rms_norm, rms_norm, silu_mul

    w = torch.linspace(0.5, 1.5, 64, device=device)

    def f(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        n, h = add_rms_norm(x, r, w, 1e-5)
        return silu_mul(torch.cat([rms_norm(h, w, 1e-5), n], -1))

    x, r = torch.randn(2, 64, device=device), torch.randn(2, 64, device=device)
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(x, r), f(x, r))


def check_model(device: str) -> None:
    """A random 2-layer model with fused gate/up: logits and K/V with the kernels equal those without, for the whole
    model and for its first layer alone as a slice (hidden states out: the last MLP output added at the end)."""
    import partition.model as pm
    from partition.checkpoint import random_model
    from partition.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 300, 192, 2, 6, 2, 32, 1000, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    model = pm.fuse_projections(random_model(cfg, seed=3, dtype=torch.float32, device=device))
    ids = torch.arange(1, 9, dtype=torch.int32, device=device)[None]
    pos = torch.arange(8, dtype=torch.int32, device=device)[None]
    for end in (2, 1):
        sl = model.slice(0, end)
        past = [torch.zeros(1, 2, 0, 32, device=device) for _ in range(2 * end)]
        with torch.inference_mode():
            fused = sl(ids, pos, *past)
            pm.FUSED_ELEMENTWISE = False
            try:
                eager = sl(ids, pos, *past)
            finally:
                pm.FUSED_ELEMENTWISE = True
        assert fused[0].shape == ((1, 1, 300) if end == 2 else (1, 8, 192))
        for a, b in zip(fused, eager):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (end, (a - b).abs().max())


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
def test_norm_kernels_in_triton_interpreter() -> None:
    run_in_interpreter("from tests.test_norm_triton import check_kernels, check_model, check_traceable; "
                       "check_kernels('cpu'); check_model('cpu'); check_traceable('cpu')", timeout=300)


def test_kernels_stay_off_on_a_plain_cpu_tensor() -> None:
    """Without the interpreter a CPU tensor keeps the eager formulation (the ONNX export traces it)."""
    import os

    from kernels.norm_triton import applies

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    assert not applies(torch.zeros(2, 8))


@pytest.mark.cuda
def test_norm_kernels_cuda() -> None:
    check_kernels("cuda")
    check_model("cuda")
    check_traceable("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_norm_kernels_compile_for_orin_and_hopper(arch: int) -> None:
    """Both kernels compile to SASS for sm_87 (Orin) and sm_90 without a GPU (scripts/kv_kernel_sass.py's
    compile), with no spills to the stack, at SmolLM2's hidden size (1024-column block) and in fp16."""
    from kernels import norm_triton
    from scripts.kv_kernel_sass import compile_kernel, resources

    types = {**{n: "*fp16" for n in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr")}, "eps": "fp32"}
    norm = compile_kernel(norm_triton._rms_norm_kernel, types, {"HAS_RES": True, "BLOCK": 1024}, arch, warps=4,
                          stages=1)
    silu = compile_kernel(norm_triton._silu_mul_kernel, {"g_ptr": "*fp16", "y_ptr": "*fp16"},
                          {"BLOCK": norm_triton.SILU_BLOCK}, arch, warps=4, stages=1)
    for k in (norm, silu):
        assert k.asm["cubin"] and resources(k)["stack_bytes"] == 0
