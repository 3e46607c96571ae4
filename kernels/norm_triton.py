"""One Triton kernel each for the elementwise parts of a decoder layer that eager PyTorch runs as many:
RMSNorm (with the residual add before it fused in) and SiLU(gate) * up.

Why: a batch-1 decode step of a small model on a GPU is bound by the number of kernels, not by bytes. On
an H200, SmolLM2-135M's graphed fp16 step (30 layers, its Q4_1 GGUF through kernels.int4_triton) took
2.55 ms for ~27 kernels a layer, ~3 us each, while the weights it reads take ~30 us at the copy rate
(docs/BENCHMARKS.md, "SmolLM2 on the GPU"). Eager RMSNorm is seven of those kernels (cast, square, mean,
add, rsqrt, multiply, cast and scale), twice a layer, plus the residual add; SiLU * up is two more. These
kernels make them one each, so a graphed step without torch.compile runs ~12 kernels a layer, and
torch.compile (whose inductor fuses the same ops, at a compile of ~10 s per captured bucket) stays optional.
vLLM has the same two fusions in CUDA C++ (fused_add_rms_norm, silu_and_mul); these are Triton so that
they compile for sm_87 (Orin) and sm_90 from one source and run in Triton's interpreter in CI.

Numbers: as partition.model's eager formulation rounds them. RMSNorm: h = x + residual rounded to the model
dtype, then weight * (h32 * rsqrt(mean(h32^2) + eps)) with the normalised value rounded to the model dtype
before the (exact in fp32, then rounded) product with the weight. SiLU * up: silu computed in fp32 and
rounded, then the product rounded. The sums inside the mean run in another order than ATen's, so
results can differ in the last bit.

Both are torch custom ops (torch.compile treats them as opaque calls); partition.model uses them on CUDA
where Triton is installed and `partition.model.FUSED_ELEMENTWISE` is on.

The `_a8` forms also write their output quantised for an INT4 GEMV that takes int8 activations
(kernels.int4_triton's ACT "int8": ACT8_FORMAT, by the same `act8_store` as its `act8_quant`, so the codes and
scales equal act8_quant's of the returned output bit for bit, the block sums up to their order of addition), which
saves that GEMV's separate quantise launch: 129 of them,
~1.4 us each, in a Llama-3-8B decode step on an H200 (docs/BENCHMARKS.md). Their codes have the bits that ACT says
(int4_triton.act_bits: 16 where ACT is "int16", or "auto" on a bf16 / fp16 model).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels import int4_triton, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: partition.model keeps its torch formulation
    triton = None
    tl = None

SILU_BLOCK = 1024  # columns of the intermediate size per program (SmolLM2's 1536: two programs a row)
# Columns per program of an RMSNorm that also writes int8 codes: in one program a row, Llama-3-8B's 4096-wide norm
# with the quantise took 4.8 us a call against 1.9 us without it on an H200 (profiled step, docs/BENCHMARKS.md),
# more than the separate quantise launch it replaced (1.4 us); 1024 = int4_triton.ACT8_BLOCKS' 32 blocks.
NORM_ACT8_CHUNK = 1024
# Triton reads TRITON_INTERPRET when the kernels are defined (this import), so `applies` reads it then too
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def applies(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether these kernels can take x (and RMSNorm's weight): Triton installed, x on CUDA (or in Triton's CPU
    interpreter, for the tests), unit stride along the last dim, one float dtype for both."""
    on = x.is_cuda or INTERPRETED
    return (triton is not None and on and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.float16,
                                                                            torch.bfloat16)
            and (weight is None or weight.dtype == x.dtype))


if triton is not None:
    from kernels.int4_triton import act8_store

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, q_ptr, sx, sr, sy, sh, sq, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ACT8: tl.constexpr = False,
                         CHUNK: tl.constexpr = 0, PDL: tl.constexpr = False, BITS: tl.constexpr = 8):
        """Program (row, chunk): y = w * norm(x [+ r]); with a residual also h = x + r (the new residual stream);
        ACT8: also y's ACT8_FORMAT row into q (kernels.int4_triton.act8_store; N a multiple of 64). CHUNK 0: one
        program a row; else each program writes CHUNK columns of the row (chunk program_id(1)), after the whole
        row's sum of squares, which every program of the row computes alike (from L2: 8 KB for a 4096-wide bf16
        row), so that a batch-1 row's quantise is spread over several SMs instead of one. PDL: kernels.pdl."""
        pdl.start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)  # rounded as x + a is
            if CHUNK == 0:
                tl.store(h_ptr + row * sh + cols, x, mask=m)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
        if CHUNK == 0:  # the whole row: the columns this program writes are the ones it summed
            c, mc, xc = cols, m, x32
        else:  # this program's CHUNK columns, loaded (and added) again
            c = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
            mc = c < N
            xc = tl.load(x_ptr + row * sx + c, mask=mc, other=0.0)
            if HAS_RES:
                rc = tl.load(r_ptr + row * sr + c, mask=mc, other=0.0)
                xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + row * sh + c, xc, mask=mc)
            xc = xc.to(tl.float32)
        normed = (xc * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=mc, other=0.0).to(tl.float32)
        y = (w * normed).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * sy + c, y, mask=mc)
        if ACT8:
            nb: tl.constexpr = (BLOCK if CHUNK == 0 else CHUNK) // 32
            act8_store(y.to(tl.float32), tl.program_id(1) * nb, q_ptr + row * sq, N, nb, BITS)

    @triton.jit
    def _silu_mul_kernel(g_ptr, y_ptr, q_ptr, sg, sy, sq, inter, BLOCK: tl.constexpr, ACT8: tl.constexpr = False,
                         PDL: tl.constexpr = False, BITS: tl.constexpr = 8):
        """Program (row, column block): y = silu(gate) * up, gate and up the two halves of a row of g; ACT8: also
        the block's ACT8_FORMAT codes into q's row (inter a multiple of 64). PDL: kernels.pdl."""
        pdl.start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        gate = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0).to(tl.float32)
        up = tl.load(g_ptr + row * sg + inter + cols, mask=m, other=0.0).to(tl.float32)
        s = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = (s * up).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * sy + cols, y, mask=m)
        if ACT8:
            act8_store(y.to(tl.float32), tl.program_id(1) * (BLOCK // 32), q_ptr + row * sq, inter, BLOCK // 32,
                       BITS)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _act8_rows(x: Tensor, k: int, act8: bool) -> Tensor:
    """The (rows, act8_width(k)) int8 output of an `_a8` op (a 1-element placeholder without act8)."""
    if not act8:
        return torch.empty((1, 1), device=x.device, dtype=torch.int8)
    if k % 64:
        raise ValueError(f"int8 activations (ACT8_FORMAT) take a last dim that is a multiple of 64, got {k}")
    return torch.empty((_rows(x).shape[0], int4_triton.act8_width(k, int4_triton.act_bits(x.dtype))), device=x.device,
                       dtype=torch.int8)


def _fake_act8(x: Tensor) -> Tensor:
    return x.new_empty((_rows(x).shape[0], int4_triton.act8_width(x.shape[-1], int4_triton.act_bits(x.dtype))),
                       dtype=torch.int8)


def _launch_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                 act8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    x2 = _rows(x)
    n = x2.shape[1]
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    h = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else y
    q = _act8_rows(x, n, act8)
    r2 = _rows(residual) if residual is not None else x2
    y2, h2 = _rows(y), _rows(h)
    block = triton.next_power_of_2(n)
    chunk = NORM_ACT8_CHUNK if act8 and block > NORM_ACT8_CHUNK else 0
    _rms_norm_kernel[(x2.shape[0], triton.cdiv(n, chunk) if chunk else 1)](
        x2, r2, weight, y2, h2, q, x2.stride(0), r2.stride(0), y2.stride(0), h2.stride(0), q.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=block, ACT8=act8, BITS=int4_triton.act_bits(x.dtype), CHUNK=chunk,
        num_warps=min(8, max(1, block // 256)),
        **pdl.launch_args(x, x2.shape[0]))
    return y, h, q


def _check_residual(x: Tensor, residual: Tensor) -> None:
    if residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm takes x and residual of one shape and dtype with unit last stride, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")


@torch.library.custom_op("orin_agent::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * RMSNorm(x) over the last dim, in x's dtype (module docstring)."""
    return _launch_norm(x, None, weight, eps)[0]


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("orin_agent::rms_norm_a8", mutates_args=())
def rms_norm_a8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x, weight, eps), its ACT8_FORMAT codes (rows, act8_width(D))): the module docstring."""
    y, _, q = _launch_norm(x, None, weight, eps, act8=True)
    return y, q


@rms_norm_a8.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), _fake_act8(x)


@torch.library.custom_op("orin_agent::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(weight * RMSNorm(x + residual), x + residual): the post-attention norm and the residual stream it reads."""
    _check_residual(x, residual)
    return _launch_norm(x, residual, weight, eps)[:2]


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("orin_agent::add_rms_norm_a8", mutates_args=())
def add_rms_norm_a8(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """add_rms_norm's two outputs and the normed one's ACT8_FORMAT codes."""
    _check_residual(x, residual)
    return _launch_norm(x, residual, weight, eps, act8=True)


@add_rms_norm_a8.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x), _fake_act8(x)


def _launch_silu(gate_up: Tensor, act8: bool = False) -> tuple[Tensor, Tensor]:
    g2 = _rows(gate_up)
    inter = g2.shape[1] // 2
    if g2.shape[1] % 2:
        raise ValueError(f"silu_mul takes cat(gate, up), an even last dim, got {gate_up.shape[-1]}")
    y = torch.empty((*gate_up.shape[:-1], inter), device=gate_up.device, dtype=gate_up.dtype)
    y2 = _rows(y)
    q = _act8_rows(y, inter, act8)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(inter, SILU_BLOCK))](g2, y2, q, g2.stride(0), y2.stride(0),
                                                                    q.stride(0), inter, BLOCK=SILU_BLOCK,
                                                                    ACT8=act8, BITS=int4_triton.act_bits(gate_up.dtype),
                                                                    num_warps=4,
                                                                    **pdl.launch_args(gate_up, g2.shape[0]))
    return y, q


@torch.library.custom_op("orin_agent::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) along the last dim (a fused gate/up projection's output)."""
    return _launch_silu(gate_up)[0]


@silu_mul.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("orin_agent::silu_mul_a8", mutates_args=())
def silu_mul_a8(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """(silu_mul(gate_up), its ACT8_FORMAT codes (rows, act8_width(inter)))."""
    return _launch_silu(gate_up, act8=True)


@silu_mul_a8.register_fake
def _(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    y = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    return y, _fake_act8(y)
