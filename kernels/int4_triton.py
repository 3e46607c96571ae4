"""Triton kernels for weight-only INT4 linears on CUDA: a batch-1 (small-M) GEMV that streams the packed
codes once, and a dequantise kernel for prefill (M > GEMV_MAX_M rows: bf16/fp16 weight once per call,
then cuBLAS through F.linear). Both are torch custom ops (`orin_agent::int4_gemv`,
`orin_agent::int4_dequant`) with fake implementations, so inductor and CUDA graphs take them whole
inside the compiled decode step; the split-K partial sums and the cast stay outside the op, where
inductor fuses them into the next pointwise kernel. `kernels.weight_only.QuantLinear` picks them
(kernel "int4_triton") and keeps the plain dequantise-then-matmul as the reference.

Weight form: w[n, k] = q[n, k] * s[n, g] + b[n, g], g = k // group_size (sequential groups of a multiple
of 32), which is both GPTQ/AWQ's (q - z) * s (b = -z * s) and GGUF Q4_1's q * d + m (b = m).

Layout (built once by `pack`, from the canonical (N, K) codes):
  codes int32 (N, K / 8): word w of row n holds, in nibble i (bits 4i..4i+3), the code of column
    32 * (w // 4) + 4 * i + w % 4. Four consecutive words (one 16-byte load) are one 32-column block:
    a thread unpacks nibble plane i of its four words into four consecutive columns, so its slice of
    the activation is one 8-byte load per plane, and a block never straddles a group.
  sb fp16 (N, G, 2): (s, b) per row and group, interleaved (one sector holds both). fp16 holds GGUF's
    own d and m exactly; for (q - z) * s, b = -z * s rounds to fp16 (2^-11 relative).

GEMV (`_gemv_kernel`): a program owns BLOCK_N rows and one of `split` equal K ranges; per step it loads
NB blocks of each row (NB * 16 bytes, whole 32-byte sectors), masks each nibble in place and reads its
bits as an fp32 denormal, q * 2^(p - 149) (`_plane_bits`: one LOP3 per weight, no shift, no int->float
conversion), FMAs it with the activation pre-scaled by 2^(49 - p), so every product is exactly
q * x * 2^-100, sums a block's 32 products in fp32 and applies the group's s and b once per block:
acc += 2^100 s * sum(q * x) + b * sum(x). Partial sums (split, M, N) fp32. sm_90 SASS: ~3.1
instructions per weight in the loop (scripts/int4_kernel_sass.py), against ~4.2 the issue rate allows
at the copy rate. Range: exact for |x| < 2^79; products under 2^-26 in magnitude lose relative precision
(as denormals), which no bf16 / fp16 result can show.
Why this and not tl.dot on tensor cores: for M = 1 the dot needs M padded to 16 and the dequantised
tile moved through shared memory into the MMA operand layout; a prototype of it compiled for sm_90 had
7.8-8.7 SASS instructions per weight in its loop (bf16 operands), against ~3 here.

Why our own kernel rather than a library's (docs/BENCHMARKS.md, "INT4 GEMV in Triton"): tinygemm
(`aten._weight_int4pack_mm`) streams at ~35 % of the copy rate at batch 1; GemLite (dropbox/gemlite,
pure Triton, pip) autotunes at first call and reduces split-K with atomics into a zeroed output;
Marlin-class kernels are CUDA C++ extensions to build per target (vLLM's, IST-DASLab/marlin), not a pip
wheel for L4T. JetPack ships no Triton either (see kernels/kv_triton.py): on Orin this path needs a
Triton built for the board, and QuantLinear falls back to tinygemm where Triton is absent.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: QuantLinear uses tinygemm / the reference instead
    triton = None
    tl = None

BLOCK_COLS = 32  # columns per 4-word block of the packed layout
GEMV_MAX_M = 4  # up to this many rows the GEMV (one pass over the codes per row, L2-shared); above, dequant + cuBLAS


def available() -> bool:
    return triton is not None


def supports(n: int, k: int, group_size: int) -> bool:
    """Shapes the layout takes: K and the group a multiple of the 32-column block."""
    return k % BLOCK_COLS == 0 and group_size % BLOCK_COLS == 0 and k % group_size == 0 and n > 0


def pack(q: Tensor, scales: Tensor, zeros: Tensor | None = None, mins: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes q (N, K) in [0, 16), scales (N, G) and either integer/float zero points (w = (q - z) * s) or
    float minimums (w = q * s + m) -> (codes int32 (N, K / 8), sb fp16 (N, G, 2)) in this module's layout."""
    n, k = q.shape
    if k % BLOCK_COLS:
        raise ValueError(f"INT4 Triton layout needs K a multiple of {BLOCK_COLS}, got K={k}")
    if (zeros is None) == (mins is None):
        raise ValueError("pack takes either zeros (w = (q - z) * s) or mins (w = q * s + m)")
    blocks = q.to(torch.int64).reshape(n, k // BLOCK_COLS, 8, 4)  # (N, block, nibble i, word j): column 4i + j
    words = torch.zeros(n, k // BLOCK_COLS, 4, dtype=torch.int64, device=q.device)
    for i in range(8):
        words |= blocks[:, :, i, :] << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed
    s = scales.float()
    b = mins.float() if mins is not None else -zeros.float() * s
    sb = torch.stack([s, b], dim=-1).to(torch.float16).contiguous()
    return words.reshape(n, k // 8).contiguous(), sb


def unpack(codes: Tensor) -> Tensor:
    """The (N, K) uint8 codes back from `pack`'s layout (tests, tools)."""
    n, kw = codes.shape
    w = codes.reshape(n, kw // 4, 1, 4)
    shifts = (4 * torch.arange(8, device=codes.device, dtype=torch.int32)).reshape(1, 1, 8, 1)
    return ((w >> shifts) & 15).reshape(n, kw * 8).to(torch.uint8)


if triton is not None:

    @triton.jit
    def _plane_bits(w, w_hi, I: tl.constexpr):
        """Nibble plane I of packed words w (w_hi = w >> 12), its bits alone reinterpreted as fp32: the
        number q * 2^(p - 149) (a denormal, or for p = 20 the smallest normals, where the int -> float
        map is still linear) for its bit position p = 4 I - 12 (I // 6) <= 20. One LOP3 with one immediate
        per weight, no conversion: multiplied by x * 2^(49 - p), the FFMA adds exactly q * x * 2^-100
        (NVIDIA GPUs run fp32 denormals at full rate; Triton emits no flush-to-zero)."""
        if I <= 5:
            return (w & (15 << (4 * I))).to(tl.float32, bitcast=True)
        else:
            return (w_hi & (15 << (4 * I - 12))).to(tl.float32, bitcast=True)

    @triton.jit
    def _plane(w, w_hi, I: tl.constexpr):
        """Nibble plane I as fp32 q, exactly: the nibble at bit p of the mantissa under an exponent of
        2^(23 - p) is the float 2^(23 - p) + q (p <= 19, so nibbles 5-7 come from w_hi), less that
        constant (for the dequantise kernel)."""
        if I <= 4:
            v = (w & (15 << (4 * I))) | ((150 - 4 * I) << 23)
            return v.to(tl.float32, bitcast=True) - 2.0 ** (23 - 4 * I)
        else:
            v = (w_hi & (15 << (4 * I - 12))) | ((162 - 4 * I) << 23)
            return v.to(tl.float32, bitcast=True) - 2.0 ** (35 - 4 * I)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, sb_ptr, out_ptr, M, N, KW, KW_SPLIT, stride_xm,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr):
        """out[split, m, rows] = partial sums of x[m] . w[rows] over this split's K range (see the module
        docstring for the layout). Grid: (M, cdiv(N, BLOCK_N), split); M fastest, so the programs of one
        weight tile run together and the second row's read of it hits L2. EVEN: N a multiple of BLOCK_N
        and every split full (no masks)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        bi = tl.arange(0, NB)
        ji = tl.arange(0, 4)
        n_groups = (KW * 8) // GROUP
        w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * KW + (bi[:, None] * 4 + ji[None, :])[None, :, :]
        sb_rows = sb_ptr + rows.to(tl.int64)[:, None] * (n_groups * 2)
        x_row = x_ptr + pid_m * stride_xm
        acc = tl.zeros((BLOCK_N, NB), tl.float32)
        lo = pid_s * KW_SPLIT
        hi = tl.minimum(lo + KW_SPLIT, KW)
        for kw in range(lo, hi, 4 * NB):
            kw = tl.multiple_of(kw, 4 * NB)
            blk = kw // 4 + bi  # (NB,) 32-column blocks of this step
            bmask = blk * 4 < hi
            xcol = blk[:, None] * 32 + ji[None, :]  # (NB, 4): columns of plane 0
            g = (blk * 32) // GROUP
            sbp = sb_rows + g[None, :] * 2
            if EVEN:
                w = tl.load(w_rows + kw, eviction_policy="evict_first")  # (BLOCK_N, NB, 4) int32: streamed once
                sv = tl.load(sbp)
                bv = tl.load(sbp + 1)
                x0 = tl.load(x_row + xcol).to(tl.float32)
            else:
                w = tl.load(w_rows + kw, mask=rmask[:, None, None] & bmask[None, :, None], other=0,
                            eviction_policy="evict_first")
                m2 = rmask[:, None] & bmask[None, :]
                sv = tl.load(sbp, mask=m2, other=0.0)
                bv = tl.load(sbp + 1, mask=m2, other=0.0)
                x0 = tl.load(x_row + xcol, mask=bmask[:, None], other=0.0).to(tl.float32)
            w_hi = w >> 12
            xs = x0
            t = _plane_bits(w, w_hi, 0) * (x0 * 2.0 ** 49)[None, :, :]
            for i in tl.static_range(1, 8):
                if EVEN:
                    xi = tl.load(x_row + xcol + 4 * i).to(tl.float32)
                else:
                    xi = tl.load(x_row + xcol + 4 * i, mask=bmask[:, None], other=0.0).to(tl.float32)
                t += _plane_bits(w, w_hi, i) * (xi * 2.0 ** (49 - 4 * i + 12 * (i // 6)))[None, :, :]
                xs += xi
            dot = tl.sum(t, axis=2)  # (BLOCK_N, NB): sum over the block of q * x, times 2^-100
            xsum = tl.sum(xs, axis=1)  # (NB,): sum of x over the block
            acc += dot * (sv.to(tl.float32) * 2.0 ** 100) + bv.to(tl.float32) * xsum[None, :]
        out = tl.sum(acc, axis=1)
        if EVEN:
            tl.store(out_ptr + (pid_s * M + pid_m) * N + rows, out)
        else:
            tl.store(out_ptr + (pid_s * M + pid_m) * N + rows, out, mask=rmask)

    @triton.jit
    def _dequant_kernel(w_ptr, sb_ptr, out_ptr, N, KW, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        NB: tl.constexpr):
        """out (N, K) = q * s + b in out's dtype, one (BLOCK_N rows, NB blocks) tile per program."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        blk = pid_k * NB + tl.arange(0, NB)
        bmask = blk * 4 < KW
        ji = tl.arange(0, 4)
        n_groups = (KW * 8) // GROUP
        r64 = rows.to(tl.int64)
        m3 = rmask[:, None, None] & bmask[None, :, None]
        w = tl.load(w_ptr + r64[:, None, None] * KW + (blk[:, None] * 4 + ji[None, :])[None, :, :], mask=m3, other=0)
        sbp = sb_ptr + r64[:, None] * (n_groups * 2) + ((blk * 32) // GROUP)[None, :] * 2
        s = tl.load(sbp, mask=rmask[:, None] & bmask[None, :], other=0.0).to(tl.float32)[:, :, None]
        b = tl.load(sbp + 1, mask=rmask[:, None] & bmask[None, :], other=0.0).to(tl.float32)[:, :, None]
        w_hi = w >> 12
        o_rows = out_ptr + r64[:, None, None] * (KW * 8) + (blk[:, None] * 32 + ji[None, :])[None, :, :]
        for i in tl.static_range(8):
            val = _plane(w, w_hi, i) * s + b
            tl.store(o_rows + 4 * i, val.to(out_ptr.dtype.element_ty), mask=m3)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, NB, num_warps, split) for an (N, K) weight on a GPU of `sms` multiprocessors: enough
    programs for ~4 per SM (split-K where N alone gives too few), each split at least 8 steps long."""
    block_n, nb, warps = 512, 2, 4
    kw = k // 8
    tiles = -(-n // block_n)
    step = 4 * nb
    split = 1
    while tiles * split < 4 * sms and kw // (split * 2) >= 8 * step:
        split *= 2
    return block_n, nb, warps, split


def _split_words(k: int, split: int, nb: int) -> int:
    step = 4 * nb
    kw = k // 8
    return -(-kw // (split * step)) * step  # words per split, a multiple of the step


@torch.library.custom_op("orin_agent::int4_gemv", mutates_args=())
def int4_gemv(x: Tensor, codes: Tensor, sb: Tensor, group_size: int, split: int) -> Tensor:
    """Partial sums (split, M, N) fp32 of x (M, K) @ W^T for the packed W (codes, sb); sum over dim 0."""
    m, k = x.shape
    n = codes.shape[0]
    block_n, nb, warps, _ = gemv_config(n, k, _sm_count(x.device.index or 0) if x.is_cuda else 132)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (m, triton.cdiv(n, block_n), split)
    words = _split_words(k, split, nb)
    even = n % block_n == 0 and words * split == k // 8
    _gemv_kernel[grid](x, codes, sb, out, m, n, k // 8, words, x.stride(0),
                       GROUP=group_size, BLOCK_N=block_n, NB=nb, EVEN=even, num_warps=warps)
    return out


@int4_gemv.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, group_size: int, split: int) -> Tensor:
    return x.new_empty((split, x.shape[0], codes.shape[0]), dtype=torch.float32)


@torch.library.custom_op("orin_agent::int4_dequant", mutates_args=())
def int4_dequant(codes: Tensor, sb: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """The (N, K) weight q * s + b in `dtype` from the packed (codes, sb)."""
    n, kw = codes.shape
    out = torch.empty((n, kw * 8), device=codes.device, dtype=dtype)
    block_n, nb = 32, 4
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(kw // 4, nb))](codes, sb, out, n, kw, GROUP=group_size,
                                                                        BLOCK_N=block_n, NB=nb, num_warps=4)
    return out


@int4_dequant.register_fake
def _(codes: Tensor, sb: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    return codes.new_empty((codes.shape[0], codes.shape[1] * 8), dtype=dtype)


def gemv_split(n: int, k: int, device: torch.device) -> int:
    """The split-K factor of an (N, K) weight's GEMV on `device`: chosen once, when the layer is built,
    so that nothing under torch.compile queries the device."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return gemv_config(n, k, sms)[3]


def linear(x2: Tensor, codes: Tensor, sb: Tensor, group_size: int, split: int) -> Tensor:
    """x2 (M, K) @ W^T -> (M, N) in x2's dtype: the GEMV for M <= GEMV_MAX_M (split-K partials summed
    here, where inductor fuses the sum and the cast into the next kernel), else dequantise once and
    F.linear (cuBLAS / inductor's mm)."""
    if x2.shape[0] > GEMV_MAX_M:
        return torch.nn.functional.linear(x2, int4_dequant(codes, sb, group_size, x2.dtype))
    partial = int4_gemv(x2.contiguous(), codes, sb, group_size, split)
    return (partial[0] if split == 1 else partial.sum(0)).to(x2.dtype)
