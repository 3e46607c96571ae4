"""Triton kernels for weight-only INT4 linears on CUDA: a batch-1 (small-M) GEMV that streams the packed
codes once, and for prefill (M > GEMV_MAX_M rows) `int4_mm`, the dequantise inside a Triton GEMM, up to
MM_MAX_M rows, and above them a dequantise kernel (a bf16/fp16 weight once per call, then cuBLAS through
F.linear): PREFILL. They are torch custom ops (`orin_agent::int4_gemv`,
`orin_agent::int4_dequant`) with fake implementations, so inductor and CUDA graphs take them whole
inside the compiled decode step. The GEMV's split-K partial sums are added inside the kernel by default
(`REDUCE`: fp32 atomics into a per-layer scratch that the tile's last program casts and zeroes, or a
deterministic sum in split order; `int4_gemv_reduced`), or returned for torch to sum (`int4_gemv`).
`kernels.weight_only.QuantLinear` picks them (kernel "int4_triton") and keeps the plain
dequantise-then-matmul as the reference.

Weight form: w[n, k] = q[n, k] * s[n, g] + b[n, g], g = k // group_size (sequential groups of a multiple
of 32), which is both GPTQ/AWQ's (q - z) * s (b = -z * s) and GGUF Q4_1's q * d + m (b = m).

Layout (built once by `pack`, from the canonical (N, K) codes):
  codes int32 (NT, K / 64, T, 8), T = tile_rows(N) rows per tile (512, or 128 for N < 4096), rows past N
    zero: [t, step, r, w] is word w of row t * T + r's step, and word w holds, in nibble i (bits
    4i..4i+3), the code of column 64 step + 32 (w // 4) + 4 i + w % 4. One GEMV step of a program reads
    the tile's T * 32 bytes as one contiguous chunk (row-major codes, 32 bytes per row per step
    across thousands of rows at once, streamed at 18-28 % of the copy rate on an H200); a thread's four
    consecutive words are one 32-column block, so its slice of the activation is one 8-byte load per
    nibble plane, and a block never straddles a group.
  sb fp16 (NT, G, T, 2): (s, b) per row and group, tiled the same way. fp16 holds GGUF's own d and m
    exactly; for (q - z) * s, b = -z * s rounds to fp16 (2^-11 relative).

GEMV (`_gemv_kernel`): a program owns one tile and one of `split` equal step ranges; per step it masks
each nibble in place and reads its bits as an fp32 denormal, q * 2^(p - 149) (`_plane_bits`: one LOP3
per weight, no shift, no int->float conversion), FMAs it with the activation pre-scaled by 2^(49 - p),
so every product is exactly q * x * 2^-100, sums a block's 32 products in fp32 and applies the group's
s and b once per block: acc += 2^100 s * sum(q * x) + b * sum(x). Partial sums (split, M, N) fp32.
sm_90 SASS: ~3.1-3.5 instructions per weight in the loop (scripts/int4_kernel_sass.py) against ~4.2
the issue rate allows at the copy rate; what bounds it is a DRAM round trip per step, hence short
programs (gemv_config). Range: exact for |x| < 2^79; products under 2^-26 in magnitude lose relative
precision (as denormals), which no bf16 / fp16 result can show.
Why this and not tl.dot on tensor cores: for M = 1 the dot needs M padded to 16 and the dequantised
tile moved through shared memory into the MMA operand layout; a prototype of it compiled for sm_90 had
7.8-8.7 SASS instructions per weight in its loop (bf16 operands), against ~3 here.

Why our own kernel rather than a library's (docs/BENCHMARKS.md, "INT4 GEMV in Triton"): tinygemm
(`aten._weight_int4pack_mm`) streams at ~35 % of the copy rate at batch 1; GemLite (dropbox/gemlite,
pure Triton, pip) autotunes at first call, reduces split-K with atomics into a zeroed output, and on
an H200 ran slower than this kernel on every Llama-3-8B shape, and than tinygemm, at 10x the error;
Marlin-class kernels are CUDA C++ extensions to build per target (vLLM's, IST-DASLab/marlin), not a pip
wheel for L4T. JetPack ships no Triton either (see kernels/kv_triton.py): on Orin this path needs a
Triton built for the board, and QuantLinear falls back to tinygemm where Triton is absent.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: QuantLinear uses tinygemm / the reference instead
    triton = None
    tl = None

from kernels import kv_triton, pdl, rope_triton

BLOCK_COLS = 32  # columns per 4-word block of the packed layout
STEP_WORDS = 8  # packed words per row per GEMV step: two blocks, 32 bytes (a whole sector)
TILE_N = 512  # rows per tile for N >= 4096 (128 below): one GEMV step reads tile * 32 contiguous bytes
GEMV_MAX_M = 4  # up to this many rows the GEMV (one pass over the codes per row, L2-shared); above, dequant + cuBLAS


def available() -> bool:
    return triton is not None


def supports(n: int, k: int, group_size: int) -> bool:
    """Shapes the layout takes: K a multiple of a step's 64 columns, the group a multiple of the 32-column block."""
    return k % (8 * STEP_WORDS) == 0 and group_size % BLOCK_COLS == 0 and k % group_size == 0 and n > 0


def tile_rows(n: int) -> int:
    """Rows per tile for an N-row weight: 512 for big layers (measured best on an H200 for N = 4096 ..
    128256, docs/BENCHMARKS.md), 128 for small ones, where a 512-row tile would be mostly padding."""
    return TILE_N if n >= 4096 else 128


def pack(q: Tensor, scales: Tensor, zeros: Tensor | None = None, mins: Tensor | None = None,
         tile_n: int | None = None) -> tuple[Tensor, Tensor]:
    """Codes q (N, K) in [0, 16), scales (N, G) and either integer/float zero points (w = (q - z) * s) or
    float minimums (w = q * s + m) -> (codes int32 (NT, K / 64, tile_n, 8), sb fp16 (NT, G, tile_n, 2)),
    NT = ceil(N / tile_n), rows past N zero (their s and b too); tile_n defaults to tile_rows(N)."""
    n, k = q.shape
    tile_n = tile_rows(n) if tile_n is None else tile_n
    if k % (8 * STEP_WORDS):
        raise ValueError(f"INT4 Triton layout needs K a multiple of {8 * STEP_WORDS}, got K={k}")
    if (zeros is None) == (mins is None):
        raise ValueError("pack takes either zeros (w = (q - z) * s) or mins (w = q * s + m)")
    nt = -(-n // tile_n)
    pad = nt * tile_n - n
    blocks = q.to(torch.int64).reshape(n, k // BLOCK_COLS, 8, 4)  # (N, block, nibble i, word j): column 4i + j
    words = torch.zeros(n, k // BLOCK_COLS, 4, dtype=torch.int64, device=q.device)
    for i in range(8):
        words |= blocks[:, :, i, :] << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed
    words = torch.nn.functional.pad(words.reshape(n, k // 8), (0, 0, 0, pad))
    codes = words.reshape(nt, tile_n, k // (8 * STEP_WORDS), STEP_WORDS).transpose(1, 2).contiguous()
    s = scales.float()
    b = mins.float() if mins is not None else -zeros.float() * s
    sb = torch.nn.functional.pad(torch.stack([s, b], dim=-1), (0, 0, 0, 0, 0, pad))  # (NT * tile_n, G, 2)
    sb = sb.reshape(nt, tile_n, -1, 2).transpose(1, 2).to(torch.float16).contiguous()
    return codes, sb


def unpack(codes: Tensor, n: int) -> Tensor:
    """The (N, K) uint8 codes back from `pack`'s layout (tests, tools)."""
    nt, ks, tn, sw = codes.shape
    w = codes.transpose(1, 2).reshape(nt * tn, ks * sw)[:n].reshape(n, ks * sw // 4, 1, 4)
    shifts = (4 * torch.arange(8, device=codes.device, dtype=torch.int32)).reshape(1, 1, 8, 1)
    return ((w >> shifts) & 15).reshape(n, ks * sw * 8).to(torch.uint8)


def unpack_sb(sb: Tensor, n: int) -> Tensor:
    """The (N, G, 2) fp16 (s, b) per row and group back from `pack`'s tiled layout (QuantLinear.concat, tools)."""
    return sb.transpose(1, 2).reshape(-1, sb.shape[1], 2)[:n]


if triton is not None:

    @triton.jit
    def _dp4a_u4(a, b, c, ASM: tl.constexpr, B_SIGNED: tl.constexpr = True):
        """c + the dot of a's four unsigned bytes with b's four signed bytes, per int32 element (PTX dp4a.u32.s32:
        one instruction from sm_61, Orin's sm_87 and Hopper's sm_90 included; it is how llama.cpp's CUDA
        mat-vec kernels multiply 4-bit weights with int8 activations); B_SIGNED False: b's bytes unsigned
        (dp4a.u32.u32: the low bytes of int16 activations, `act8_store` BITS 16). ASM False: the same sum in
        integer ops, for Triton's CPU interpreter, which runs no inline assembly."""
        if ASM:
            if B_SIGNED:
                return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = c
            for i in tl.static_range(4):
                if B_SIGNED:
                    r += ((a >> (8 * i)) & 255) * ((b << (24 - 8 * i)) >> 24)
                else:
                    r += ((a >> (8 * i)) & 255) * ((b >> (8 * i)) & 255)
            return r

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
    def _ld_b32(ptr, ASM: tl.constexpr):
        """A load of 32-bit words as inline PTX, which Triton's coalescing pass leaves in the layout its users
        want (a tl.load of (s, b) words takes a layout of 4 rows a thread, which the GEMV's products then meet
        through shared memory and two barriers a step). ASM False: tl.load (the CPU interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return tl.load(ptr)

    @triton.jit
    def _sb_words(sb_tile, st, bi, GROUP: tl.constexpr, TN: tl.constexpr, RB: tl.constexpr = False,
                  ASM: tl.constexpr = True):
        """Step st's packed (s, b) words per row: (TN, 1) when its two blocks share a group, else (TN, 2).
        RB: (TN, 2) a row and block either way, loaded by `_ld_b32` (in the products' layout)."""
        if RB:
            words = _ld_b32(sb_tile + (((st * 2 + bi) * 32) // GROUP)[None, :] * TN, ASM)
        elif GROUP >= 64:
            words = tl.load(sb_tile + ((st * 64) // GROUP) * TN)
        else:
            words = tl.load(sb_tile + (((st * 2 + bi) * 32) // GROUP)[None, :] * TN)
        return words

    @triton.jit
    def _merge_cols(x_row, mo_ptr, mm_ptr, ml_ptr, pid_m, lo, hi, NSPL, NH, BLOCK_S: tl.constexpr,
                    MHD: tl.constexpr):
        """MERGE: the decode attention's output columns [64 lo, 64 hi) of row pid_m, merged from its splits' partials
        as kernels.kv_triton's merge kernel merges them (o (M, NH, NSPL, MHD), m and l (M, NH, NSPL) fp32:
        sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j, empty splits weighing nothing), stored in x_row's dtype."""
        s = tl.arange(0, BLOCK_S)
        s_ok = s < NSPL
        for st in range(lo, hi):
            cols = st * 64 + tl.arange(0, 64)
            head = (pid_m * NH + cols // MHD) * NSPL  # (64,): the first split of each column's head
            at = head[None, :] + s[:, None]  # (BLOCK_S, 64)
            m = tl.load(mm_ptr + at, mask=s_ok[:, None], other=-float("inf"))
            big = tl.max(m, axis=0)
            w = kv_triton.split_weights(m, big[None, :])
            den = tl.sum(tl.load(ml_ptr + at, mask=s_ok[:, None], other=0.0) * w, axis=0)
            o = tl.load(mo_ptr + at * MHD + (cols % MHD)[None, :], mask=s_ok[:, None], other=0.0)
            tl.store(x_row + cols, (tl.sum(o * w, axis=0) / den).to(x_row.dtype.element_ty))

    @triton.jit
    def _gemv_tile(x_ptr, w_ptr, sb_ptr, KS, STEPS_SPLIT, stride_xm, pid_m, pid_t, pid_s,
                   GROUP: tl.constexpr, TN: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                   UNROLL: tl.constexpr, ACT8: tl.constexpr = False, ASM: tl.constexpr = True,
                   PDL: tl.constexpr = False, CHAIN: tl.constexpr = False, BITS: tl.constexpr = 8,
                   MERGE: tl.constexpr = False, mo_ptr=None, mm_ptr=None, ml_ptr=None, NSPL=1, NH=1,
                   BLOCK_S: tl.constexpr = 2, MHD: tl.constexpr = 64):
        """(TN,) fp32: x[pid_m] . w[rows of tile pid_t] over the steps of split pid_s (layout: the module
        docstring). PREFETCH: the next step's codes and (s, b) are loaded into registers before this step's
        arithmetic, so a program keeps one DRAM read in flight while it computes (instead of STAGES' shared-
        memory ring). ACT8: x_ptr is an activation packed by `act8_quant` (ACT8_FORMAT, as int32 words, row
        stride stride_xm words); the dot runs on dp4a (`_dp4a_u4`), four weights an instruction. BITS 16: the
        activation is int16 codes (ACT "int16"), their high bytes then their low bytes: two dp4a a word each.
        PDL (kernels.pdl): the loop is PREFETCH's whatever PREFETCH says, and the wait for the kernels before comes
        after the first step's codes and (s, b) are loaded, before the activation's first load: the weights no kernel
        writes (with the wait first instead, the step measured 4 % slower than without PDL on an H200).
        CHAIN: the loop's form, LOOP's "chain" (else "planes"). MERGE: x is the decode attention's output, which
        this program first merges from its splits' partials for its own columns (`_merge_cols`) into x_ptr, a scratch
        row that every program of the same split writes with the same values, then reads back as x."""
        r = tl.arange(0, TN)
        bi = tl.arange(0, 2)
        ji = tl.arange(0, 4)
        n_groups = (KS * 64) // GROUP
        w_tile = w_ptr + pid_t.to(tl.int64) * KS * (TN * 8) + (r[:, None, None] * 8 + bi[None, :, None] * 4
                                                               + ji[None, None, :])  # (TN, 2, 4)
        # (s, b) as one 32-bit word per row and group (s in the low half): one load per row for groups of 64 and
        # more (a step's two blocks share their group), two for 32, instead of a 16-bit load per value
        sb_tile = sb_ptr.to(tl.pointer_type(tl.int32)) + pid_t.to(tl.int64) * n_groups * TN + r[:, None]  # (TN, 1)
        x_row = x_ptr + pid_m * stride_xm
        # ACT8: (d, sum) per block, after the K codes (BITS 16: after the K high bytes and the K low bytes)
        xd_row = (x_row + KS * (BITS * 2)).to(tl.pointer_type(tl.float32))
        acc = tl.zeros((TN, 2), tl.float32)
        lo = pid_s * STEPS_SPLIT
        hi = tl.minimum(lo + STEPS_SPLIT, KS)
        AHEAD: tl.constexpr = PREFETCH or PDL
        if AHEAD:  # addresses clamped into the split (no masks): the last step re-reads its own chunk from L2
            nx = tl.minimum(lo, KS - 1)
            w_next = tl.load(w_tile + nx * (TN * 8), eviction_policy="evict_first")
            sb_next = _sb_words(sb_tile, nx, bi, GROUP, TN, CHAIN, ASM)
        pdl.wait(PDL)
        if MERGE:
            _merge_cols(x_row, mo_ptr, mm_ptr, ml_ptr, pid_m, lo, hi, NSPL, NH, BLOCK_S, MHD)
            tl.debug_barrier()  # the program's columns stored by every thread before any reads them as x
        # cp.async ring: STAGES - 1 steps in flight; UNROLL > 1: that many steps a loop iteration (their loads issued
        # together where the registers allow)
        for st in tl.range(lo, hi, num_stages=STAGES, loop_unroll_factor=UNROLL):
            blk = st * 2 + bi  # (2,) the step's 32-column blocks
            xcol = blk[:, None] * 32 + ji[None, :]  # (2, 4): columns of plane 0
            if AHEAD:
                w, sbw = w_next, sb_next
                nx = tl.minimum(st + 1, hi - 1)
                w_next = tl.load(w_tile + nx * (TN * 8), eviction_policy="evict_first")
                sb_next = _sb_words(sb_tile, nx, bi, GROUP, TN, CHAIN, ASM)
            else:
                w = tl.load(w_tile + st * (TN * 8), eviction_policy="evict_first")  # TN * 32 contiguous bytes
                sbw = _sb_words(sb_tile, st, bi, GROUP, TN, CHAIN, ASM)
            sv = (sbw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            bv = (sbw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            if ACT8:
                # words (blk, p, j) of the quantised x: byte c holds column 32 blk + 8 c + 4 p + j, which is what
                # the even (p = 0) and odd (p = 1) nibbles of weight word j hold once spread one to a byte
                xw = x_row + st * 16 + bi[:, None] * 8 + ji[None, :]  # (2, 4)
                xa = tl.load(xw)[None, :, :]
                xb = tl.load(xw + 4)[None, :, :]
                xdp = xd_row + (st * 2 + bi) * 2
                xd = tl.load(xdp)  # (2,): the blocks' scales d
                xsum = tl.load(xdp + 1)  # (2,): the blocks' sums of x
                we = w & 0x0F0F0F0F
                wo = (w >> 4) & 0x0F0F0F0F
                t = _dp4a_u4(we, xa, tl.zeros((TN, 2, 4), tl.int32), ASM)
                t = _dp4a_u4(wo, xb, t, ASM)
                if BITS == 16:  # xq = 256 hi + lo, lo unsigned: 256 (q . hi) + q . lo; |sum| < 15 * 2^15 * 32 < 2^24
                    t = _dp4a_u4(we, tl.load(xw + KS * 16)[None, :, :], t << 8, ASM, B_SIGNED=False)
                    t = _dp4a_u4(wo, tl.load(xw + KS * 16 + 4)[None, :, :], t, ASM, B_SIGNED=False)
                dot = tl.sum(t, axis=2).to(tl.float32)  # (TN, 2): sum over each block of q * xq, exact
                acc += dot * (sv * xd[None, :]) + bv * xsum[None, :]
            elif CHAIN:
                w_hi = w >> 12
                # the step's four words j of a row and block apart, (TN, 2) each (a thread holds all four)
                wa, wb = tl.split(tl.reshape(w, (TN, 2, 2, 2)))
                w0, w2 = tl.split(wa)
                w1, w3 = tl.split(wb)
                ha, hb = tl.split(tl.reshape(w_hi, (TN, 2, 2, 2)))
                h0, h2 = tl.split(ha)
                h1, h3 = tl.split(hb)
                dot = tl.zeros((TN, 2), tl.float32)
                xs = tl.zeros((2, 4), tl.float32)
                for i in tl.static_range(8):
                    xi = tl.load(x_row + xcol + 4 * i).to(tl.float32)
                    xs += xi
                    xw = tl.broadcast_to((xi * 2.0 ** (49 - 4 * i + 12 * (i // 6)))[None, :, :], (TN, 2, 4))
                    xa, xb = tl.split(tl.reshape(xw, (TN, 2, 2, 2)))  # as the words: the same registers
                    x0, x2 = tl.split(xa)
                    x1, x3 = tl.split(xb)
                    # one chain of fused multiply-adds a row and block (tl.fma: whatever fp fusion says)
                    dot = tl.fma(_plane_bits(w0, h0, i), x0, dot)
                    dot = tl.fma(_plane_bits(w1, h1, i), x1, dot)
                    dot = tl.fma(_plane_bits(w2, h2, i), x2, dot)
                    dot = tl.fma(_plane_bits(w3, h3, i), x3, dot)
                xsum = tl.sum(xs, axis=1)  # (2,): sum of x over each block
                acc = tl.fma(dot, sv * 2.0 ** 100, tl.fma(bv, xsum[None, :], acc))  # dot: q . x times 2^-100
            else:  # LOOP "planes": a chain a word, summed over the words, (s, b) as tl.load lays them out
                x0 = tl.load(x_row + xcol).to(tl.float32)
                w_hi = w >> 12
                xs = x0
                t = _plane_bits(w, w_hi, 0) * (x0 * 2.0 ** 49)[None, :, :]
                for i in tl.static_range(1, 8):
                    xi = tl.load(x_row + xcol + 4 * i).to(tl.float32)
                    t += _plane_bits(w, w_hi, i) * (xi * 2.0 ** (49 - 4 * i + 12 * (i // 6)))[None, :, :]
                    xs += xi
                dot = tl.sum(t, axis=2)  # (TN, 2): sum over each block of q * x, times 2^-100
                xsum = tl.sum(xs, axis=1)  # (2,): sum of x over each block
                acc += dot * (sv * 2.0 ** 100) + bv * xsum[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, sb_ptr, out_ptr, M, N, KS, STEPS_SPLIT, stride_xm,
                     GROUP: tl.constexpr, TN: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                     PREFETCH: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr = False,
                     ASM: tl.constexpr = True, CHAIN: tl.constexpr = False):
        """out[split, m, rows] = partial sums of x[m] . w[rows] over this split's steps. Grid: (M, tiles,
        split); M fastest, so the programs of one weight tile run together and a second row's read of it
        hits L2. EVEN: N a multiple of TN (no store mask)."""
        pdl.trigger(PDL)
        pid_m = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_s = tl.program_id(2)
        out = _gemv_tile(x_ptr, w_ptr, sb_ptr, KS, STEPS_SPLIT, stride_xm, pid_m, pid_t, pid_s, GROUP, TN,
                         STAGES, PREFETCH, UNROLL, ASM=ASM, PDL=PDL, CHAIN=CHAIN)
        rows = pid_t * TN + tl.arange(0, TN)
        if EVEN:
            tl.store(out_ptr + (pid_s * M + pid_m) * N + rows, out)
        else:
            tl.store(out_ptr + (pid_s * M + pid_m) * N + rows, out, mask=rows < N)

    @triton.jit
    def _sum_squares(h_ptr, pid_m, K, c0, c1, HB: tl.constexpr):
        """sum(h[pid_m, c0:c1]^2) in fp32, HB columns a load (one load where c1 - c0 <= HB, as a split's are)."""
        acc = tl.zeros((HB,), tl.float32)
        for c in range(c0, c1, HB):
            cols = c + tl.arange(0, HB)
            v = tl.load(h_ptr + pid_m * K + cols, mask=cols < c1, other=0.0).to(tl.float32)
            acc += v * v
        return tl.sum(acc, axis=0)

    @triton.jit
    def _gemv_finish(tot, ss, resv, gv, y_ptr, ws_ptr, cnt_ptr, xg_ptr, eps, pid_m, pid_t, N, NT, K, PAIR_OFF,
                     TN: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr, RES: tl.constexpr, XG: tl.constexpr,
                     NORM: tl.constexpr, SILU: tl.constexpr, XQ: tl.constexpr = False, BITS: tl.constexpr = 8,
                     XQW=0):
        """A tile's whole sum tot (TN,) fp32 to y, through the epilogue the flags ask for (`int4_gemv_epilogue`):
        NORM: times 1 / sqrt(ss / K + eps), ss the sum of squares of the norm's input row (x was that row times the
        norm's weight); RES: plus resv (the residual's rows, loaded ahead); XG: also xg = y * gv (the next norm's
        weight's rows, loaded ahead); SILU: the weight's first N / 2 rows are gates, the rest ups: the tile pairs
        with the tile N / 2 rows on, and the second of the pair to finish writes silu(gate) * up. XQ: xg (with
        SILU: also the product) goes to xg_ptr as the next GEMV's ACT8_FORMAT codes of BITS bits (rows of XQW
        bytes; `act8_store`, the tile's TN / 32 blocks) instead of in y's dtype."""
        r = tl.arange(0, TN)
        rows = pid_t * TN + r
        ok = rows < N
        dt = y_ptr.dtype.element_ty
        if NORM:
            tot = tot * tl.rsqrt(ss / K + eps)  # norm_triton's RMSNorm formula
        if SILU:  # N / 2 a multiple of TN (`silu_pairs`): no masks
            tl.store(ws_ptr + pid_m * N + rows, tot)  # (normed) for the pair's second program
            tl.debug_barrier()  # stored before the pair's count is released
            half = NT // 2
            pair = pid_t % half
            pc = cnt_ptr + PAIR_OFF + pid_m * half + pair
            if tl.atomic_add(pc, 1, sem="acq_rel") == 1:
                other = tl.load(ws_ptr + pid_m * N + ((pid_t + half) % NT) * TN + r, cache_modifier=".cg")
                first = pid_t < half
                gate = tl.where(first, tot, other)
                up = tl.where(first, other, tot)
                s = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # rounded as norm_triton's silu_mul
                prod = (s * up).to(dt)
                tl.store(y_ptr + pid_m * (N // 2) + pair * TN + r, prod)
                if XQ:
                    act8_store(prod.to(tl.float32), pair * (TN // 32), xg_ptr + pid_m * XQW, N // 2, TN // 32, BITS)
                zero = tl.zeros((TN,), tl.float32)
                tl.store(ws_ptr + pid_m * N + pair * TN + r, zero)
                tl.store(ws_ptr + pid_m * N + (pair + half) * TN + r, zero)
                tl.atomic_xchg(pc, 0, sem="relaxed")
        else:
            if RES:
                tot += resv
            y = tot.to(dt)
            tl.store(y_ptr + pid_m * N + rows, y, mask=ok)
            if XG:
                xgv = (y.to(tl.float32) * gv).to(dt)
                if XQ:  # rows past N: 0 (whatever the masked load of the sum left there)
                    act8_store(tl.where(ok, xgv.to(tl.float32), 0.0), pid_t * (TN // 32), xg_ptr + pid_m * XQW, N,
                               TN // 32, BITS)
                else:
                    tl.store(xg_ptr + pid_m * N + rows, xgv, mask=ok)

    @triton.jit
    def _rope_tile(y_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, pid_m, row0, N, s_cs, s_p, skc_b, skc_h, skc_s,
                   svc_b, svc_h, svc_s, NH, NKV, TN: tl.constexpr, HD: tl.constexpr):
        """The ROPE epilogue of a q/k/v GEMV's tile, rows [row0, row0 + TN) of y[pid_m] (M, N), stored: its q heads
        rotated in place, its k heads rotated into kc[pid_m, head, pos[pid_m]], its v heads copied into vc at that
        slot; kernels.rope_triton's `rotate` on the same (rounded) y as its kernel, so the same values.
        The tile's heads whole (TN a multiple of HD), y's rows [0, NH HD) q, then NKV heads of k, NKV of v."""
        half = tl.arange(0, HD // 2)
        c1, c2, s1, s2 = rope_triton.cos_sin(cos_ptr, sin_ptr, pid_m * s_cs, HD)
        slot = tl.load(pos_ptr + pid_m * s_p).to(tl.int64)
        yrow = y_ptr + pid_m * N
        for j in tl.static_range(TN // HD):
            head = row0 // HD + j
            src = yrow + head * HD
            if head < NH + NKV:  # q or k: rotated
                r1, r2 = rope_triton.rotate(tl.load(src + half, cache_modifier=".cg").to(tl.float32),
                                            tl.load(src + HD // 2 + half, cache_modifier=".cg").to(tl.float32),
                                            c1, c2, s1, s2)
                if head < NH:
                    tl.store(src + half, r1.to(y_ptr.dtype.element_ty))
                    tl.store(src + HD // 2 + half, r2.to(y_ptr.dtype.element_ty))
                else:
                    dst = kc_ptr + pid_m * skc_b + (head - NH) * skc_h + slot * skc_s
                    tl.store(dst + half, r1.to(kc_ptr.dtype.element_ty))
                    tl.store(dst + HD // 2 + half, r2.to(kc_ptr.dtype.element_ty))
            elif head < NH + 2 * NKV:  # v: copied
                full = tl.arange(0, HD)
                vals = tl.load(src + full, cache_modifier=".cg")
                tl.store(vc_ptr + pid_m * svc_b + (head - NH - NKV) * svc_h + slot * svc_s + full,
                         vals.to(vc_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_reduced_kernel(x_ptr, w_ptr, sb_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, NT, KS, STEPS_SPLIT, stride_xm,
                             GROUP: tl.constexpr, TN: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr,
                             CH: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                             UNROLL: tl.constexpr, ACT8: tl.constexpr = False, ASM: tl.constexpr = True,
                             PDL: tl.constexpr = False, CHAIN: tl.constexpr = False, BITS: tl.constexpr = 8,
                             res_ptr=None, g_ptr=None,
                             xg_ptr=None, h_ptr=None, ss_ptr=None, eps=0.0, PAIR_OFF=0, RES: tl.constexpr = False,
                             XG: tl.constexpr = False, NORM: tl.constexpr = False, SILU: tl.constexpr = False,
                             HB: tl.constexpr = 64, XQ: tl.constexpr = False, XQW=0, cos_ptr=None, sin_ptr=None,
                             pos_ptr=None, kc_ptr=None, vc_ptr=None, s_cs=0, s_p=0, skc_b=0, skc_h=0, skc_s=0,
                             svc_b=0, svc_h=0, svc_s=0, NH=0, NKV=0, ROPE: tl.constexpr = False,
                             HD: tl.constexpr = 64, MERGE: tl.constexpr = False, mo_ptr=None, mm_ptr=None,
                             ml_ptr=None, NSPL=1, MNH=1, BLOCK_S: tl.constexpr = 2, MHD: tl.constexpr = 64):
        """y[m, rows] = x[m] . w[rows] in y's dtype, the split-K sum done in this kernel (REDUCE_MODES):
        every program of a (row, tile) adds its partial into the fp32 scratch (MODE 1: atomically into
        ws (M, N), which the last program zeroes again; MODE 2: its own slice of ws (SPLIT, M, N), which the
        last program sums in split order, CH splits per load), then counts itself in cnt (M, NT); the
        program that counts last writes y and resets its counter to 0, so the scratch is as it was found
        after every call (what lets the op declare no mutation, and CUDA graphs replay it). ACT8: x is
        packed by `act8_quant` (see `_gemv_tile`); y_ptr's dtype is the output's. PDL: kernels.pdl.
        RES, XG, NORM, SILU, XQ: the epilogue's (`_gemv_finish`; XQ's codes of BITS bits, as ACT8's input). The
        epilogue's inputs are read by every program before it counts itself, so the last one finds them in
        registers: the residual's and the next weight's rows, and for NORM the sum of squares of h[m] over the
        program's own columns (HB at most), which MODE 1 adds up in ss_ptr (M, NT) fp32 beside the partials (MODE 2
        keeps its sums in order: the last program reads all of h). ROPE: after y's tile is stored, `_rope_tile` (the
        rotations and the cache writes of a q/k/v GEMV, NH and NKV heads of HD rows). MERGE: `_gemv_tile`'s (MNH
        heads of MHD columns, NSPL splits)."""
        pdl.trigger(PDL)
        pid_m = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_s = tl.program_id(2)
        out = _gemv_tile(x_ptr, w_ptr, sb_ptr, KS, STEPS_SPLIT, stride_xm, pid_m, pid_t, pid_s, GROUP, TN,
                         STAGES, PREFETCH, UNROLL, ACT8, ASM, PDL, CHAIN, BITS, MERGE, mo_ptr, mm_ptr, ml_ptr, NSPL,
                         MNH, BLOCK_S, MHD)
        rows = pid_t * TN + tl.arange(0, TN)
        ok = rows < N
        K = KS * 64
        resv = tl.zeros((TN,), tl.float32)
        gv = tl.zeros((TN,), tl.float32)
        if RES:
            resv = tl.load(res_ptr + pid_m * N + rows, mask=ok, other=0.0).to(tl.float32)
        if XG:
            gv = tl.load(g_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        ss = 0.0
        if SPLIT == 1:
            if NORM:
                ss = _sum_squares(h_ptr, pid_m, K, 0, K, HB)
            _gemv_finish(out, ss, resv, gv, y_ptr, ws_ptr, cnt_ptr, xg_ptr, eps, pid_m, pid_t, N, NT, K, PAIR_OFF,
                         TN, SPLIT, MODE, RES, XG, NORM, SILU, XQ, BITS, XQW)
            if ROPE:
                tl.debug_barrier()  # the tile's y stored by every thread before it is read back
                _rope_tile(y_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, pid_m, pid_t * TN, N, s_cs, s_p, skc_b,
                           skc_h, skc_s, svc_b, svc_h, svc_s, NH, NKV, TN, HD)
        else:
            if MODE == 1:
                tl.atomic_add(ws_ptr + pid_m * N + rows, out, mask=ok, sem="relaxed")
                if NORM:  # this program's columns' share of the row's sum of squares
                    c0 = pid_s * STEPS_SPLIT * 64
                    part_ss = _sum_squares(h_ptr, pid_m, K, c0, tl.minimum(c0 + STEPS_SPLIT * 64, K), HB)
                    tl.atomic_add(ss_ptr + pid_m * NT + pid_t, part_ss, sem="relaxed")
            else:
                tl.store(ws_ptr + (pid_s * M + pid_m) * N + rows, out, mask=ok)
            tl.debug_barrier()  # every thread's partial issued before the count is released (CUTLASS's split-K semaphore)
            done = tl.atomic_add(cnt_ptr + pid_m * NT + pid_t, 1, sem="acq_rel")
            if done == SPLIT - 1:
                if MODE == 1:
                    tot = tl.load(ws_ptr + pid_m * N + rows, mask=ok, cache_modifier=".cg")
                    if NORM:
                        ss = tl.load(ss_ptr + pid_m * NT + pid_t, cache_modifier=".cg")
                        tl.store(ss_ptr + pid_m * NT + pid_t, 0.0)
                    if not SILU:  # (with SILU the pair's second program zeroes both rows)
                        tl.store(ws_ptr + pid_m * N + rows, tl.zeros((TN,), tl.float32), mask=ok)
                else:
                    tot = tl.zeros((TN,), tl.float32)
                    for s0 in tl.static_range(0, SPLIT, CH):
                        sp = s0 + tl.arange(0, CH)
                        part = tl.load(ws_ptr + (sp[:, None] * M + pid_m) * N + rows[None, :],
                                       mask=(sp[:, None] < SPLIT) & ok[None, :], other=0.0, cache_modifier=".cg")
                        tot += tl.sum(part, axis=0)
                    if NORM:
                        ss = _sum_squares(h_ptr, pid_m, K, 0, K, HB)
                _gemv_finish(tot, ss, resv, gv, y_ptr, ws_ptr, cnt_ptr, xg_ptr, eps, pid_m, pid_t, N, NT, K,
                             PAIR_OFF, TN, SPLIT, MODE, RES, XG, NORM, SILU, XQ, BITS, XQW)
                if ROPE:
                    tl.debug_barrier()
                    _rope_tile(y_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, pid_m, pid_t * TN, N, s_cs, s_p,
                               skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, NH, NKV, TN, HD)
                tl.atomic_xchg(cnt_ptr + pid_m * NT + pid_t, 0, sem="relaxed")

    @triton.jit
    def _dequant_planes(w, sv, bv, dt: tl.constexpr, RB: tl.constexpr):
        """The weights q * s + b in dt of one layout step as the eight planes joined, (RB, 2, 4, 2, 2, 2): w the
        step's (RB, 2, 4) words, sv / bv the (RB, 2) fp16 s and b of its two blocks. Reshaped to (RB, 64) without
        a permute, column f holds the step's column `_plane_column(f)`."""
        s = sv.to(tl.float32)[:, :, None]
        b = bv.to(tl.float32)[:, :, None]
        w_hi = w >> 12
        p0 = (_plane(w, w_hi, 0) * s + b).to(dt)
        p1 = (_plane(w, w_hi, 1) * s + b).to(dt)
        p2 = (_plane(w, w_hi, 2) * s + b).to(dt)
        p3 = (_plane(w, w_hi, 3) * s + b).to(dt)
        p4 = (_plane(w, w_hi, 4) * s + b).to(dt)
        p5 = (_plane(w, w_hi, 5) * s + b).to(dt)
        p6 = (_plane(w, w_hi, 6) * s + b).to(dt)
        p7 = (_plane(w, w_hi, 7) * s + b).to(dt)
        # (RB, 2 block, 4 j, 2 c, 2 b, 2 a) with plane i = 4a + 2b + c
        v = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
        return v

    @triton.jit
    def _dequant_planes_i2f(w, sv, bv, dt: tl.constexpr, RB: tl.constexpr):
        """`_dequant_planes`' values and order by another route: nibble plane I masked in place is the integer
        q 2^(4I), which I2FP (sm_86 and newer: the unsigned conversion Triton emits) turns into that float
        exactly, and the group's s scaled by 2^(-4I) (exact) brings it back in the multiply-add: a LOP3, an
        I2FP and an FFMA a weight, against two LOP3s, an FADD and an FFMA."""
        s = sv.to(tl.float32)[:, :, None]
        b = bv.to(tl.float32)[:, :, None]
        u = w.to(tl.uint32, bitcast=True)
        p0 = ((u & 0xF).to(tl.float32) * s + b).to(dt)
        p1 = ((u & 0xF0).to(tl.float32) * (s * 0.0625) + b).to(dt)
        p2 = ((u & 0xF00).to(tl.float32) * (s * 0.00390625) + b).to(dt)
        p3 = ((u & 0xF000).to(tl.float32) * (s * 2.0 ** -12) + b).to(dt)
        p4 = ((u & 0xF0000).to(tl.float32) * (s * 2.0 ** -16) + b).to(dt)
        p5 = ((u & 0xF00000).to(tl.float32) * (s * 2.0 ** -20) + b).to(dt)
        p6 = ((u & 0xF000000).to(tl.float32) * (s * 2.0 ** -24) + b).to(dt)
        p7 = ((u & 0xF0000000).to(tl.float32) * (s * 2.0 ** -28) + b).to(dt)
        return tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))

    @triton.jit
    def _plane_column(f):
        """The step column (32 block + 4 i + j) that `_dequant_planes`' flattened index f holds."""
        return 32 * (f // 32) + 16 * (f % 2) + 8 * ((f // 2) % 2) + 4 * ((f // 4) % 2) + (f // 8) % 4

    @triton.jit
    def _dequant_step(w, sv, bv, dt: tl.constexpr, RB: tl.constexpr):
        """(RB, 64) weights q * s + b in dt of one layout step, columns in order (the planes permuted back)."""
        v = _dequant_planes(w, sv, bv, dt, RB)
        return tl.reshape(tl.permute(v, (0, 1, 5, 4, 3, 2)), (RB, 64))

    @triton.jit
    def _dequant_program(w_ptr, sb_ptr, out_ptr, N, KS, pid_t, st, pid_r, GROUP: tl.constexpr, TN: tl.constexpr,
                         RB: tl.constexpr):
        """Rows pid_r * RB .. + RB of tile pid_t, step st of out (N, K) = q * s + b in out's dtype: RB * 32
        contiguous bytes of codes in, RB rows of 64 consecutive values out."""
        r = pid_r * RB + tl.arange(0, RB)
        bi = tl.arange(0, 2)
        ji = tl.arange(0, 4)
        n_groups = (KS * 64) // GROUP
        w = tl.load(w_ptr + (pid_t.to(tl.int64) * KS + st) * (TN * 8)
                    + (r[:, None, None] * 8 + bi[None, :, None] * 4 + ji[None, None, :]))  # (TN, 2, 4)
        blk = st * 2 + bi
        sbp = (sb_ptr + pid_t.to(tl.int64) * n_groups * (TN * 2) + ((blk * 32) // GROUP)[None, :] * (TN * 2)
               + r[:, None] * 2)
        v = _dequant_step(w, tl.load(sbp), tl.load(sbp + 1), out_ptr.dtype.element_ty, RB)
        rows = pid_t * TN + r
        cols = st * 64 + tl.arange(0, 64)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * (KS * 64) + cols[None, :], v, mask=(rows < N)[:, None])

    @triton.jit
    def _dequant_kernel(w_ptr, sb_ptr, out_ptr, N, KS, GROUP: tl.constexpr, TN: tl.constexpr, RB: tl.constexpr):
        """out (N, K) = q * s + b in out's dtype, one (tile, step, RB-row chunk) per program."""
        _dequant_program(w_ptr, sb_ptr, out_ptr, N, KS, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                         GROUP, TN, RB)

    @triton.jit
    def _dequant_nth(pid, w_ptr, sb_ptr, out_ptr, N, KS, GROUP: tl.constexpr, TN: tl.constexpr, RB: tl.constexpr):
        """Program pid of one weight's (tile, step, chunk) grid, flattened chunk fastest."""
        c: tl.constexpr = TN // RB
        _dequant_program(w_ptr, sb_ptr, out_ptr, N, KS, pid // (KS * c), (pid // c) % KS, pid % c, GROUP, TN, RB)

    @triton.jit
    def _dequant_many_kernel(w0, sb0, o0, n0, ks0, e0, w1, sb1, o1, n1, ks1, e1, w2, sb2, o2, n2, ks2, e2,
                             w3, sb3, o3, n3, ks3, e3, NW: tl.constexpr, GROUP: tl.constexpr,
                             T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
                             R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
        """Up to four weights dequantised in one launch (`dequant_many`): program ids [0, e0) are weight 0's
        `_dequant_kernel` grid flattened, [e0, e1) weight 1's, and so on (e: cumulative program counts)."""
        pid = tl.program_id(0)
        if pid < e0:
            _dequant_nth(pid, w0, sb0, o0, n0, ks0, GROUP, T0, R0)
        else:
            if NW > 1:
                if pid < e1:
                    _dequant_nth(pid - e0, w1, sb1, o1, n1, ks1, GROUP, T1, R1)
                else:
                    if NW > 2:
                        if pid < e2:
                            _dequant_nth(pid - e1, w2, sb2, o2, n2, ks2, GROUP, T2, R2)
                        else:
                            if NW > 3:
                                _dequant_nth(pid - e2, w3, sb3, o3, n3, ks3, GROUP, T3, R3)

    @triton.jit
    def _mm_kernel(x_ptr, w_ptr, sb_ptr, y_ptr, M, N, KS, stride_xm, STEPS_SPLIT, GROUP: tl.constexpr,
                   TN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, GM: tl.constexpr,
                   SWAP: tl.constexpr = True, I2F: tl.constexpr = False, SPLIT: tl.constexpr = 1):
        """y (M, N) = x (M, K) @ W^T for M > GEMV_MAX_M with the dequantise inside the GEMM: a program owns
        a (BM, BN) block of y (BN rows of one layout tile). Per 64-column step it loads BN * 32 bytes of codes and
        BN * 2 (s, b) words, dequantises them in registers (`_dequant_planes`, or `_dequant_planes_i2f` with I2F:
        the same values) and permutes the planes back to column order, which stays inside each thread; the
        activation's (BM, 64) block is contiguous rows. The pipeliner copies all three ahead (cp.async) over
        STAGES steps. SWAP: the weight is tl.dot's register operand and the activation, transposed in shared
        memory, the other (acc (BN, BM) = W . x^T, as swap-AB W4A16 kernels do); else the weight, transposed in
        registers, is the shared-memory operand (acc (BM, BN) = x . W^T). fp32 accumulation, y in x's dtype.
        Programs run in groups of GM M blocks a weight block (the grouped order of Triton's matmul tutorial), so
        the readers of a weight block run together and all but the first find it in L2: the weight crosses DRAM
        once, as 4-bit codes, instead of as a bf16 copy written and read again. SPLIT > 1 (split-K, where the
        blocks of y are fewer than the SMs): program_id(1) takes STEPS_SPLIT of the KS steps and adds its sum into
        y, a zeroed fp32 buffer, atomically."""
        pid = tl.program_id(0)
        per = GM * tl.cdiv(N, BN)
        first_m = (pid // per) * GM
        gm = tl.minimum(tl.cdiv(M, BM) - first_m, GM)
        pid_m = first_m + (pid % per) % gm
        n0 = ((pid % per) // gm) * BN
        r = (n0 % TN) + tl.arange(0, BN)
        bi = tl.arange(0, 2)
        ji = tl.arange(0, 4)
        n_groups = (KS * 64) // GROUP
        w_blk = w_ptr + (n0 // TN).to(tl.int64) * KS * (TN * 8) + (r[:, None, None] * 8 + bi[None, :, None] * 4
                                                                    + ji[None, None, :])
        # (s, b) as one 32-bit word a row and group (sb_ptr: the fp16 pairs seen as int32), so that the pipeliner
        # copies them ahead with the codes (cp.async takes 4, 8 or 16 bytes; two 2-byte loads were issued in line)
        sb_blk = sb_ptr + (n0 // TN).to(tl.int64) * n_groups * TN + r[:, None]
        rm = pid_m * BM + tl.arange(0, BM)
        x_blk = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + tl.arange(0, 64)[None, :]  # (BM, 64)
        m_ok = rm < M
        if SWAP:
            acc = tl.zeros((BN, BM), tl.float32)
        else:
            acc = tl.zeros((BM, BN), tl.float32)
        lo = tl.program_id(1) * STEPS_SPLIT
        for st in tl.range(lo, tl.minimum(lo + STEPS_SPLIT, KS), num_stages=STAGES):
            w = tl.load(w_blk + st * (TN * 8))
            sbw = tl.load(sb_blk + (((st * 2 + bi) * 32) // GROUP)[None, :] * TN)  # (BN, 2) words
            sv = (sbw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
            bv = (sbw >> 16).to(tl.int16).to(tl.float16, bitcast=True)
            xt = tl.load(x_blk + st * 64, mask=m_ok[:, None], other=0.0)
            if I2F:
                v6 = _dequant_planes_i2f(w, sv, bv, x_ptr.dtype.element_ty, BN)
            else:
                v6 = _dequant_planes(w, sv, bv, x_ptr.dtype.element_ty, BN)
            if SWAP:  # the planes permuted back to column order (inside each thread), as _dequant_step does
                acc = tl.dot(tl.reshape(tl.permute(v6, (0, 1, 5, 4, 3, 2)), (BN, 64)), tl.trans(xt), acc)
            else:
                acc = tl.dot(xt, tl.reshape(tl.permute(v6, (1, 5, 4, 3, 2, 0)), (64, BN)), acc)
        rn = n0 + tl.arange(0, BN)
        if SWAP:
            y_at = y_ptr + rm.to(tl.int64)[None, :] * N + rn[:, None]
            ok = m_ok[None, :] & (rn < N)[:, None]
        else:
            y_at = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
            ok = m_ok[:, None] & (rn < N)[None, :]
        if SPLIT > 1:
            tl.atomic_add(y_at, acc, mask=ok, sem="relaxed")
        else:
            tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def act8_store(v, blk0, q_row, K, NB: tl.constexpr, BITS: tl.constexpr = 8):
        """Quantise NB 32-column blocks of an activation row, blocks blk0 .. blk0 + NB, as llama.cpp's Q8_1 does
        (d = max |x| / 127 a block, codes round(x / d) to nearest even), into q_row, the row's ACT8_FORMAT bytes
        (K columns); v: the blocks' NB * 32 fp32 values in column order, 0 past K. Blocks past K are not stored.
        BITS 16 (ACT "int16"): int16 codes on a power-of-two d = 2^(e - 14), e the exponent of the block's largest
        |x|, so that every value within 2^7 of it that a bf16 holds is its code times d exactly (8 significant bits
        under 15); the codes' high bytes in the codes' place, their low bytes after them (ACT8_FORMAT).
        For the producers of a GEMV's input (RMSNorm, SiLU * up: kernels.norm_triton) and `_act8_kernel`."""
        vb = tl.reshape(v, (NB, 32))
        amax = tl.max(tl.abs(vb), axis=1)
        xsum = tl.sum(vb, axis=1)
        if BITS == 16:
            # d's biased exponent: amax's less 14, at least 1 (the smallest normal; amax < 2^(e + 1) so |x| / d < 2^15)
            de = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 14, 1)
            inv = tl.where(amax > 0, ((254 - de) << 23).to(tl.float32, bitcast=True), 0.0)  # 1 / d, exactly
            d = tl.where(amax > 0, (de << 23).to(tl.float32, bitcast=True), 0.0)
            r = (vb * inv[:, None] + 12582912.0) - 12582912.0  # |value| < 2^15: rounded to nearest even
            r = tl.minimum(r, 32767.0)  # an fp32 value within 2^-16 of 2^(e + 1) rounds to 2^15
        else:
            inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)  # all-zero blocks: codes 0
            d = amax / 127.0
            # round to nearest even by adding and taking away 1.5 * 2^23 (|value| <= 127: exact in fp32)
            r = (vb * inv[:, None] + 12582912.0) - 12582912.0
        f = tl.arange(0, 32)
        blk = blk0 + tl.arange(0, NB)
        ok = blk < K // 32
        # column f = 8 c + 4 p + j of a block goes to its byte 16 p + 4 j + c
        byte = blk[:, None] * 32 + (16 * ((f // 4) % 2) + 4 * (f % 4) + f // 8)[None, :]
        code = r.to(tl.int32)
        if BITS == 16:
            tl.store(q_row + byte, (code >> 8).to(tl.int8), mask=ok[:, None])
            tl.store(q_row + K + byte, (code & 255).to(tl.uint8).to(tl.int8, bitcast=True), mask=ok[:, None])
        else:
            tl.store(q_row + byte, code.to(tl.int8), mask=ok[:, None])
        xd = (q_row + K * (BITS // 8)).to(tl.pointer_type(tl.float32))
        tl.store(xd + blk * 2, d, mask=ok)
        tl.store(xd + blk * 2 + 1, xsum, mask=ok)

    @triton.jit
    def _act8_kernel(x_ptr, q_ptr, K, stride_xm, stride_qm, NB: tl.constexpr, PDL: tl.constexpr = False,
                     BITS: tl.constexpr = 8, w_ptr=None, HAS_W: tl.constexpr = False):
        """Row program_id(0)'s blocks program_id(1) * NB .. + NB of x into q's ACT8_FORMAT row (`act8_store`);
        HAS_W: of x times w (K,), the product in fp32 rounded to x's dtype, as torch's
        (x.float() * w.float()).to(x.dtype)."""
        pdl.start(PDL)
        m = tl.program_id(0).to(tl.int64)
        blk0 = tl.program_id(1) * NB
        cols = blk0 * 32 + tl.arange(0, NB * 32)
        v = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            v = (v * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        act8_store(v, blk0, q_ptr + m * stride_qm, K, NB, BITS)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The GEMV's loop, for measurement (scripts/bench_int4_gemv.py --sweep, bench_cuda_decode.py's variants): PREFETCH 1
# loads the next step's codes into registers before this step's arithmetic; UNROLL steps a loop iteration;
# MIN_STEPS is the fewest steps a split keeps (gemv_config). Read when a layer is built (the split) and at each launch.
# Measured on an H200 (docs/BENCHMARKS.md, seventh session): PREFETCH 1 +1.3 / +2.2 % at model level, inside the
# leases' spread, so off by default.
PREFETCH = int(os.environ.get("ORIN_AGENT_INT4_PREFETCH", "0"))
# The GEMV loop's form, read at each launch: "planes" (the default: a fused multiply-add chain a word over its 8
# nibbles, summed over the words, and the (s, b) words loaded as tl.load lays them out, 4 rows a thread, which
# the products meet through shared memory and two barriers a step) or "chain" (opt-in: the exact arithmetic as one
# chain a row and block over the step's 32 weights, and (s, b) loaded in the products' layout by inline PTX,
# `_ld_b32`, for int8 activations too). sm_90 SASS of the Llama-3-8B gate/up GEMV as it launches with PDL
# (scripts/int4_kernel_sass.py, Triton 3.9): planes 787 loop instructions, 128 registers, 2 BAR.SYNC a step; chain
# 774, 96, none (int8 activations: 274 -> 291, 2 BAR -> none). "chain" stays opt-in until a GPU has run it: its
# inline load has run only as the interpreter's tl.load, and neither form's time on it is measured
# (docs/BENCHMARKS.md, "Where the INT4 GEMV's time goes").
# FP_FUSION: the GEMV launches ask for fp contraction, which makes the "planes" chains FFMAs, instead of taking
# Triton's default, which Triton 3.9 warns turns off in 3.10: with TRITON_DEFAULT_FP_FUSION=0 that loop compiled to
# 1004 instructions (an FMUL + FADD for every FFMA), and with enable_fp_fusion=True to 787 again.
FP_FUSION = True
LOOP_FORMS = ("planes", "chain")
LOOP = os.environ.get("ORIN_AGENT_INT4_LOOP", "planes")
if LOOP not in LOOP_FORMS:
    raise ValueError(f"ORIN_AGENT_INT4_LOOP={LOOP!r}: use one of {', '.join(LOOP_FORMS)}")
UNROLL = int(os.environ.get("ORIN_AGENT_INT4_UNROLL", "1"))  # steps a loop iteration (tl.range's loop_unroll_factor)
MIN_STEPS = int(os.environ.get("ORIN_AGENT_INT4_MIN_STEPS", "2"))
# The split-K rule for a GEMV whose loop loads a step ahead (AHEAD: PREFETCH or PDL, `_gemv_tile`),
# ORIN_AGENT_INT4_AHEAD_SPLIT: 0 the dense rule (up to 16 programs an SM, as a loop that does not load ahead);
# 1 at most 8 programs an SM and a split that divides the steps; 2 (the default) at most 8 programs an SM. Rule 1, per
# kernel, on an H200 (docs/BENCHMARKS.md, "Where the INT4 GEMV's time goes", scripts/bench_gemv_anatomy.py, the loop
# loading ahead): Llama-3-8B gate/up 24.52 us at split 32 -> 23.19 at 16, down 14.41 at 64 -> 13.79 at 32. But the
# first model-level run of it (H100, 2026-12-06, bench_cuda_decode, Llama-3-8B INT4, PDL on, two interleaved runs
# each) decoded 286.1 / 287.0 tok/s with it against 307.7 / 320.7 with the dense rule, so the dense rule is the
# default on every GPU (Orin, without PDL, was always on it: there down was faster at 64, 14.58 us against 16.07).
# What cost rule 1 that run was down's split (64 -> 32, for 224 steps to divide). Rule 2 leaves down at 64 and
# changes only the widest GEMVs: gate/up 32 -> 16 and an INT4 head 8 -> 4. With int16 activations on an H100
# (2026-12-07, twenty-fifth session, docs/BENCHMARKS.md): the gate/up GEMV alone 26.50 us at split 32 against
# 23.66 at 16 (bench_int4_gemv.py --sweep-act16), and the Llama-3-8B step, two interleaved pairs, 364.9 / 363.2
# tok/s (dense) against 369.7 / 369.7 (rule 2) with an INT4 head, 336.5 against 338.9 with a bf16 head.
AHEAD_SPLIT = int(os.environ.get("ORIN_AGENT_INT4_AHEAD_SPLIT", "2"))
if AHEAD_SPLIT not in (0, 1, 2):
    raise ValueError(f"ORIN_AGENT_INT4_AHEAD_SPLIT={AHEAD_SPLIT}: use 0 (dense), 1 (8 an SM, dividing) or 2 (8 an SM)")


def gemv_config(n: int, k: int, sms: int, tile_n: int | None = None, ahead: bool = False) -> tuple[int, int, int]:
    """(num_warps, split, stages) for an (N, K) weight on a GPU of `sms` multiprocessors. Each step is a
    dependent load + ~0.3 us of arithmetic, so short programs and many of them win: split-K (a power of
    two) down to 2 steps per split, up to ~16 programs per SM. On an H200 (sweeps in docs/BENCHMARKS.md)
    this picked the best of 4 tile / split settings for every Llama-3-8B shape; a cp.async pipeline
    (stages > 1) measured 1.3-1.6x slower, so the loop is plain. `ahead`: the loop loads a step ahead
    (AHEAD_SPLIT's rule: by default up to 8 programs per SM)."""
    ks = k // (8 * STEP_WORDS)
    tiles = -(-n // (tile_rows(n) if tile_n is None else tile_n))
    rule = AHEAD_SPLIT if ahead else 0
    per_sm = 8 if rule else 16
    split = 1
    while (ks // (split * 2) >= MIN_STEPS and tiles * split * 2 <= per_sm * sms
           and not (rule == 1 and ks % (split * 2))):
        split *= 2
    return 4, split, 1


@torch.library.custom_op("orin_agent::int4_gemv", mutates_args=())
def int4_gemv(x: Tensor, codes: Tensor, sb: Tensor, n: int, group_size: int, split: int) -> Tensor:
    """Partial sums (split, M, N) fp32 of x (M, K) @ W^T for the packed W (codes, sb) of N rows."""
    m, k = x.shape
    nt, ks, tn, _ = codes.shape
    warps, _, stages = gemv_config(n, k, 132, tn)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    _gemv_kernel[(m, nt, split)](x, codes, sb, out, m, n, ks, -(-ks // split), x.stride(0), GROUP=group_size,
                                 TN=tn, EVEN=n % tn == 0, STAGES=stages, PREFETCH=PREFETCH, UNROLL=UNROLL,
                                 ASM=_asm(), CHAIN=LOOP == "chain", num_warps=warps, enable_fp_fusion=FP_FUSION,
                                 **pdl.launch_args(x, m))
    return out


@int4_gemv.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, n: int, group_size: int, split: int) -> Tensor:
    return x.new_empty((split, x.shape[0], n), dtype=torch.float32)


@torch.library.custom_op("orin_agent::int4_dequant", mutates_args=())
def int4_dequant(codes: Tensor, sb: Tensor, n: int, group_size: int, dtype: torch.dtype) -> Tensor:
    """The (N, K) weight q * s + b in `dtype` from the packed (codes, sb)."""
    out = torch.empty((n, codes.shape[1] * 64), device=codes.device, dtype=dtype)
    _dequant_into(codes, sb, out, n, group_size)
    return out


def _rows_per_program(tn: int) -> int:
    return min(tn, 256)  # rows per dequantise program: 256 measured at 72-87 % of the copy rate on an H200


def _dequant_into(codes: Tensor, sb: Tensor, out: Tensor, n: int, group_size: int) -> None:
    nt, ks, tn, _ = codes.shape
    rb = _rows_per_program(tn)
    _dequant_kernel[(nt, ks, tn // rb)](codes, sb, out, n, ks, GROUP=group_size, TN=tn, RB=rb, num_warps=4)


MANY_MAX = 4  # weights one `dequant_many` launch takes (a decoder layer's fused qkv, o, gate/up and down)


def dequant_many(weights: list[tuple[Tensor, Tensor, int]], group_size: int, dtype: torch.dtype) -> list[Tensor]:
    """The (N, K) weights q * s + b in `dtype` of up to MANY_MAX packed weights [(codes, sb, n), ...] of one group
    size, in one Triton launch, as views of one new buffer: a prefill's dequantise costs one launch a layer
    instead of one a weight, and no custom-op dispatch (eager only: the decode step, compiled, never takes this).
    What it saves is host time: the device's CPU spends ~60 us launching each dequantise (docs/BENCHMARKS.md,
    "INT4 prefill: one dequantise launch a layer"), 128 of them in a Llama-3-8B prefill."""
    if not 1 <= len(weights) <= MANY_MAX:
        raise ValueError(f"dequant_many takes 1 to {MANY_MAX} weights, got {len(weights)}")
    sizes = [n * codes.shape[1] * 64 for codes, _, n in weights]
    flat = torch.empty(sum(sizes), device=weights[0][0].device, dtype=dtype)
    outs, args, tiles, chunks, end, off = [], [], [], [], 0, 0
    for (codes, sb, n), size in zip(weights, sizes):
        nt, ks, tn, _ = codes.shape
        rb = _rows_per_program(tn)
        out = flat[off:off + size].view(n, ks * 64)
        off += size
        end += nt * ks * (tn // rb)
        outs.append(out)
        args += [codes, sb, out, n, ks, end]
        tiles.append(tn)
        chunks.append(rb)
    pad = MANY_MAX - len(weights)  # unused slots: the first weight again, never read (NW cuts the branches)
    args += args[:6] * pad
    tiles += tiles[:1] * pad
    chunks += chunks[:1] * pad
    _dequant_many_kernel[(end,)](*args, NW=len(weights), GROUP=group_size, T0=tiles[0], T1=tiles[1], T2=tiles[2],
                                 T3=tiles[3], R0=chunks[0], R1=chunks[1], R2=chunks[2], R3=chunks[3], num_warps=4)
    return outs


# PREFILL "graphed": each weight's dequantise captured once as a CUDA graph into a scratch buffer per (shape, dtype,
# device), then replayed: one graph launch instead of a Triton launch from Python (~92 us of host CPU a call on the
# H200's host, docs/BENCHMARKS.md "INT4 prefill with the dequantise inside the GEMM", 128 calls a Llama-3-8B
# prefill). Layers of one shape share the scratch: their dequantise and F.linear run in stream order, so a layer's
# copy is read before the next one overwrites it. Costs one scratch copy of each distinct weight shape. Measured
# slower on an H200 (Llama-3-8B INT4, prefill 512: 48.97 ms against the default's 34.25, docs/BENCHMARKS.md,
# sixth session), so it stays opt-in.
_DEQUANT_GRAPHS: dict[tuple, tuple["torch.cuda.CUDAGraph", Tensor]] = {}
_DEQUANT_SCRATCH: dict[tuple, Tensor] = {}


def dequant_graphed(codes: Tensor, sb: Tensor, n: int, group_size: int, dtype: torch.dtype) -> Tensor:
    """int4_dequant's result, from a replayed CUDA graph (module comment above): a view of a shared scratch
    buffer, valid until the next dequantise of a weight of the same shape on this stream. Off CUDA, inside a
    capture or under torch.compile: int4_dequant itself."""
    if (not codes.is_cuda or torch.cuda.is_current_stream_capturing()
            or torch.compiler.is_compiling()):
        return int4_dequant(codes, sb, n, group_size, dtype)
    key = (codes.data_ptr(), sb.data_ptr(), tuple(codes.shape), n, group_size, dtype)
    entry = _DEQUANT_GRAPHS.get(key)
    if entry is None:
        shape = (n, codes.shape[1] * 64, dtype, codes.device)
        out = _DEQUANT_SCRATCH.get(shape)
        if out is None:
            out = _DEQUANT_SCRATCH[shape] = torch.empty(shape[:2], device=codes.device, dtype=dtype)
        _dequant_into(codes, sb, out, n, group_size)  # compiles the kernel before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _dequant_into(codes, sb, out, n, group_size)
        entry = _DEQUANT_GRAPHS[key] = (graph, out)
    graph, out = entry
    graph.replay()
    return out


@int4_dequant.register_fake
def _(codes: Tensor, sb: Tensor, n: int, group_size: int, dtype: torch.dtype) -> Tensor:
    return codes.new_empty((n, codes.shape[1] * 64), dtype=dtype)


# (BM, BN, warps, stages, group_m, swap, i2f) of `_mm_kernel`; BN is capped at the layout's tile rows (it must divide
# them). Chosen by the rows M (`mm_config`): measured on an H100 (docs/BENCHMARKS.md, "The prefill GEMM timed",
# 2026-12-07, `scripts/bench_int4_gemv.py --shapes llama-3-8b-fused --rows 512,128`, nine configs), summed over a
# Llama-3-8B layer's four fused shapes: at M = 128 (128, 64, 4 warps, 4 stages, swap-AB) 330.5 us, the next 387.4;
# at M = 512 (256, 128, 8 warps, 3 stages, swap-AB, I2F) 633.0 us, the next 638.5.
# Before Hopper (Orin's sm_87) the large one spills (80 bytes of stack, Triton 3.9), so there M > MM_SMALL_M takes
# the 128 x 128 tile at 8 warps, which compiles without spills there (184 registers) and ran second at M = 512.
MM_CONFIG_SMALL = (128, 64, 4, 4, 8, 1, 0)
# ... except where those 128 x 64 blocks alone make two programs an SM (Llama-3-8B gate+up: 448 blocks at M <= 128):
# there the 128 x 128 tile at 8 warps, which reads the activation half as often: gate+up at M = 128 87.9 / 92.2 us
# against 111.6 / 112.0 (two runs), at M = 16 94.2 against 109.4.
MM_CONFIG_SMALL_WIDE = (128, 128, 8, 3, 8, 1, 0)
MM_CONFIG_LARGE = (256, 128, 8, 3, 8, 1, 1)
MM_CONFIG_LARGE_SM80 = (128, 128, 8, 3, 8, 1, 0)
# ORIN_AGENT_INT4_MM_CONFIG="BM,BN,warps,stages,group_m,swap,i2f" sets one config for every M (measurement).
MM_CONFIG: tuple[int, ...] | None = None
if os.environ.get("ORIN_AGENT_INT4_MM_CONFIG"):
    try:
        MM_CONFIG = tuple(int(v) for v in os.environ["ORIN_AGENT_INT4_MM_CONFIG"].split(","))
    except ValueError:
        MM_CONFIG = ()
    if len(MM_CONFIG) != 7:
        raise ValueError(f"ORIN_AGENT_INT4_MM_CONFIG={os.environ['ORIN_AGENT_INT4_MM_CONFIG']!r}: give 7 integers, "
                         "BM,BN,warps,stages,group_m,swap,i2f (e.g. 128,64,4,4,8,1,0), or unset it")
# int4_mm's configs: MM_CONFIG_SMALL (or _WIDE) up to MM_SMALL_M rows, MM_CONFIG_LARGE above.
MM_SMALL_M = 128
# Up to this many rows PREFILL "auto" (the default) runs `int4_mm`; above, it dequantises once for cuBLAS. Measured
# on an H100, Llama-3-8B's prefill (docs/BENCHMARKS.md, "The prefill GEMM timed"; bf16 / int4_mm / dequantise +
# cuBLAS, ms): 32 tokens 7.32 / 7.61-7.91 / 13.26-13.55; 128: 8.08 / 8.14-8.20 / 13.82-14.08; 256: 9.76 /
# 11.99-12.07 / 15.22-15.36; 512: 14.04 / 21.02-21.28 / 19.69-19.84.
MM_MAX_M = 256


def mm_config(m: int, major: int = 9, n: int = 0, sms: int = 132) -> tuple[int, ...]:
    """`_mm_kernel`'s config for M rows of an N-row weight on a GPU of compute capability `major` with `sms` SMs:
    MM_CONFIG where set, else the measured one for M's side of MM_SMALL_M."""
    if MM_CONFIG:
        return MM_CONFIG
    if m <= MM_SMALL_M:
        wide = -(-m // MM_CONFIG_SMALL[0]) * -(-n // MM_CONFIG_SMALL[1]) >= 2 * sms  # the 128 x 64 blocks
        return MM_CONFIG_SMALL_WIDE if wide else MM_CONFIG_SMALL
    return MM_CONFIG_LARGE if major >= 9 else MM_CONFIG_LARGE_SM80


# Split-K of `int4_mm` (measurement: ORIN_AGENT_INT4_MM_SPLIT=n for every call; 0 or unset: `mm_split`'s rule).
MM_SPLIT = int(os.environ.get("ORIN_AGENT_INT4_MM_SPLIT", "0") or 0)
MM_SPLIT_MIN_STEPS = 16  # 64-column steps a split keeps at least (1024 columns)


def mm_split(blocks: int, ks: int, sms: int, per_sm: int = 2) -> int:
    """Splits of K for `int4_mm` with `blocks` (BM, BN) blocks of y and ks 64-column steps on `sms` SMs: as many
    as make about `per_sm` programs an SM (a Llama-3-8B down_proj at M = 128: 64 blocks of 128 x 64 on an H100's
    132 SMs, 4), at least MM_SPLIT_MIN_STEPS steps each; 1 where the blocks alone make that many. Measured on an
    H100 (docs/BENCHMARKS.md, "The prefill GEMM timed"): at M = 128 in 128 x 64 blocks of 4 warps, qkv (96 blocks)
    42.0 us unsplit, 37.0 in 2; o (64) 41.4, 29.4 in 2, 23.4 in 4; down (64) 139.0, 85.0 in 2, 58.4 in 4; at M = 512
    in 256 x 128 blocks of 8 warps (`int4_mm` at every M, the prefill of 512 tokens) one program an SM does better:
    21.8 ms against 22.8-23.1 with two. REDUCE "last" (repeatable sums) keeps it to 2: two fp32 adds into zero give
    the same bits in either order, more may not."""
    split = min(MM_SPLIT, ks) if MM_SPLIT > 0 else max(1, min(per_sm * sms // max(blocks, 1), ks // MM_SPLIT_MIN_STEPS))
    return min(split, 2) if REDUCE == "last" else split


@functools.lru_cache(maxsize=8)
def _cc_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def mm_plan(m: int, n: int, ks: int, tn: int, device: torch.device) -> tuple[tuple[int, ...], int, int, int]:
    """How `int4_mm` launches for M rows of an N-row weight of ks 64-column steps in tiles of tn rows on `device`:
    (its config, BN capped at tn; the blocks of y; the splits of K; the steps a split)."""
    cuda = device.type == "cuda"
    sms = _sm_count(device.index or 0) if cuda else 132
    bm, bn, warps, *rest = mm_config(m, _cc_major(device.index or 0) if cuda else 9, n, sms)
    bn = min(bn, tn)
    blocks = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    per = triton.cdiv(ks, mm_split(blocks, ks, sms, 2 if warps <= 4 else 1))
    return (bm, bn, warps, *rest), blocks, triton.cdiv(ks, per), per


@torch.library.custom_op("orin_agent::int4_mm", mutates_args=())
def int4_mm(x: Tensor, codes: Tensor, sb: Tensor, n: int, group_size: int) -> Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype (bf16 / fp16: tensor-core operands), the dequantise fused
    into the GEMM (`_mm_kernel`)."""
    m, k = x.shape
    nt, ks, tn, _ = codes.shape
    (bm, bn, warps, stages, gm, swap, i2f), blocks, split, per = mm_plan(m, n, ks, tn, x.device)
    y = torch.zeros((m, n), device=x.device, dtype=torch.float32) if split > 1 else \
        torch.empty((m, n), device=x.device, dtype=x.dtype)
    _mm_kernel[(blocks, split)](x, codes, sb.view(torch.int32), y, m, n, ks, x.stride(0), per, GROUP=group_size,
                                TN=tn, BM=bm, BN=bn, STAGES=stages, GM=gm, SWAP=bool(swap), I2F=bool(i2f),
                                SPLIT=split, num_warps=warps)
    return y.to(x.dtype) if split > 1 else y


@int4_mm.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, n: int, group_size: int) -> Tensor:
    return x.new_empty((x.shape[0], n))


# How M > GEMV_MAX_M rows (prefill) run: "auto" (the default: `int4_mm` up to MM_MAX_M rows, "dequant" above;
# MM_MAX_M's measurement), "dequant" (a bf16 / fp16 copy of the weight, then cuBLAS) or "fused" (`int4_mm` for
# every M: the dequantise inside a Triton GEMM, the weight read once as codes). fp32 activations always take
# "dequant" (tl.dot's fp32 operands would run as tf32). "dequant" takes a decoder layer's weights in one launch, in
# line with the layer (weight_only.hold_prefill_weights, eager prefill); "dequant-ahead" the same a layer ahead on a
# side stream where a slice runs its layers (weight_only.LayerPrefetch: measured slower in an eager prefill, which is
# host-bound, docs/BENCHMARKS.md "INT4 prefill: where the time goes"; opt-in), "dequant-each" one launch a weight
# (the earlier form, for measurement).
PREFILL_MODES = ("auto", "dequant", "dequant-ahead", "dequant-each", "fused", "graphed")  # "graphed": opt-in, slower
PREFILL = os.environ.get("ORIN_AGENT_INT4_PREFILL", "auto")
if PREFILL not in PREFILL_MODES:
    raise ValueError(f"ORIN_AGENT_INT4_PREFILL={PREFILL!r}: use one of {', '.join(PREFILL_MODES)}")
# SMs that a prefill's cuBLAS matmuls leave free while PREFILL "dequant-ahead" dequantises the next layer on its side
# stream (weight_only.LayerPrefetch, `carve_sms`); 0: none (the matmuls take every SM). Why: graphed on an H200 the
# side stream overlapped 0.3 of the 3.4 ms of dequantise (docs/BENCHMARKS.md, ninth session), because cuBLAS's
# persistent kernels hold every SM. With n SMs left to it the dequantise runs beside the matmuls, which slow by
# ~SMs / (SMs - n), against the ~210 us a Llama-3-8B layer the dequantise costs in line (H100, twenty-second
# session). Opt-in and untimed: no GPU has run it (bench_cuda_decode.py's "int4-fused-carveN" variants).
PREFILL_CARVEOUT = int(os.environ.get("ORIN_AGENT_INT4_PREFILL_CARVEOUT", "0"))


def carve_sms(n: int):
    """Until the returned function is called, cuBLAS matmuls leave n SMs free: torch's experimental SM carveout
    (cuBLASLt's SM_COUNT_TARGET, PyTorch PR 147966), with cuBLASLt preferred meanwhile, since torch's plain cuBLAS
    calls may ignore it; the function restores both settings. None (nothing changed) where n is 0 or this torch has
    no carveout."""
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    put = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if n <= 0 or get is None or put is None:
        return None
    carve, blas = get(), torch.backends.cuda.preferred_blas_library()
    put(n)
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except RuntimeError:  # a torch built without cuBLASLt: the carveout alone
        pass

    def restore() -> None:
        put(carve)
        torch.backends.cuda.preferred_blas_library(blas)

    return restore


def prefill_fused(rows: int, dtype: torch.dtype) -> bool:
    """Whether a prefill of `rows` rows (> GEMV_MAX_M) in `dtype` runs `int4_mm` (PREFILL's rule)."""
    return dtype in (torch.bfloat16, torch.float16) and (PREFILL == "fused" or (PREFILL == "auto" and rows <= MM_MAX_M))


def gemv_split(n: int, k: int, device: torch.device) -> int:
    """The split-K factor of an (N, K) weight's GEMV on `device`: chosen once, when the layer is built,
    so that nothing under torch.compile queries the device. Whether its loop will load ahead (PREFETCH, or PDL
    on a decode launch) is read here too: a setting changed after the build leaves a valid, untuned split."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return gemv_config(n, k, sms, ahead=bool(PREFETCH) or pdl.enabled_on(device, 1))[1]


# Where the GEMV's split-K partial sums are added up: "partials" (the op returns (split, M, N) fp32 and
# `linear` sums them in torch, where inductor may fuse the sum into the next kernel: in the compiled Llama-3-8B
# INT4 step on an H200 three of the four sums a layer stayed kernels of their own, 232 us of a 3.74 ms step,
# docs/BENCHMARKS.md), "atomic" (fp32 atomic adds into a scratch row that the last program of a tile reads,
# casts and zeroes: one kernel, but the order of the adds, hence the last bit of a sum, varies from run to
# run) or "last" (each program stores its partial, the last one of a tile sums them in split order:
# one kernel, deterministic). Only layers built with a scratch (`scratch`) take the two in-kernel modes.
# Measured on an H200 (docs/BENCHMARKS.md, 2026-12-02): a GEMV alone, eager, partials -> atomic -> last: Llama-3-8B
# q/o 10.8 -> 6.8 -> 7.3 us, k/v 8.6 -> 4.8 -> 6.6, gate/up 18.1 -> 14.4 -> 14.8, down 18.1 -> 15.1 -> 18.0 (split 64:
# the last program's sum is 8 dependent loads); the compiled fused step 3.82 -> 3.55 ms with atomic. Default
# atomic; ORIN_AGENT_INT4_REDUCE=last for bit-for-bit repeatable sums (a greedy run that repeats exactly; it also
# keeps int4_mm's split-K to 2, whose atomic sum is then repeatable).
REDUCE_MODES = {"partials": 0, "atomic": 1, "last": 2}
REDUCE = os.environ.get("ORIN_AGENT_INT4_REDUCE", "atomic")
if REDUCE not in REDUCE_MODES:
    raise ValueError(f"ORIN_AGENT_INT4_REDUCE={REDUCE!r}: use one of {', '.join(REDUCE_MODES)}")
REDUCE_CHUNK = 8  # splits per load in "last" mode's sum (8 x 512 fp32 = 32 registers a thread at 4 warps)
NORM_BLOCK = 4096  # columns of h a load where the norm epilogue reads them (32 fp32 registers a thread at 4 warps)


def scratch(n: int, codes: Tensor) -> tuple[Tensor, Tensor]:
    """The zeroed fp32 row scratch (GEMV_MAX_M, N) and int32 counters (3 GEMV_MAX_M, tiles) that the in-kernel
    split-K modes use and leave zeroed (rows [0, GEMV_MAX_M): a tile's programs; then the tile pairs of the SiLU
    epilogue, `int4_gemv_epilogue`; then, as fp32 bits, the norm epilogue's sums of squares); one pair per layer
    (kernels on one stream run one after another, and a layer's calls never overlap)."""
    return (torch.zeros((GEMV_MAX_M, n), device=codes.device, dtype=torch.float32),
            torch.zeros((3 * GEMV_MAX_M, codes.shape[0]), device=codes.device, dtype=torch.int32))


def silu_pairs(n: int, tile_n: int) -> bool:
    """Whether an N-row weight of tile_n-row tiles can take the SiLU epilogue: its gate half ends on a tile's edge."""
    return n % (2 * tile_n) == 0


@torch.library.custom_op("orin_agent::int4_gemv_reduced", mutates_args=())
def int4_gemv_reduced(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
                      split: int, mode: int) -> Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, the split-K sum inside the kernel (mode: REDUCE_MODES' 1 or 2).
    ws and cnt (`scratch`) are written during the call and left zeroed: no mutation is visible after it."""
    return _reduced(x, False, x.shape[1], codes, sb, ws, cnt, n, group_size, split, mode, x.dtype)[0]


def _reduced(x: Tensor, act8: bool, k: int, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int,
             group_size: int, split: int, mode: int, dtype: torch.dtype, residual: Tensor | None = None,
             next_weight: Tensor | None = None, rms_of: Tensor | None = None, eps: float = 0.0,
             silu: bool = False, bits: int = 8, codes_out: bool = False,
             rope: tuple | None = None, merge: tuple | None = None) -> tuple[Tensor, Tensor | None]:
    """Launch `_gemv_reduced_kernel` on x (M, K) in a float dtype, or (act8) on an ACT8_FORMAT activation of
    `bits`-bit codes viewed as int32 words: (y (M, N) in dtype, or (M, N / 2) with silu; xg (M, N) where next_weight
    is given, else None), the epilogue as `int4_gemv_epilogue` describes it; codes_out: that xg (with silu: y's
    rows), as `bits`-bit ACT8_FORMAT codes instead (`int4_gemv_epilogue_a8`); rope: (cos, sin, positions, k_cache,
    v_cache, n_heads), the q/k/v epilogue of `int4_gemv_rope`; merge: (o, m, l), the decode attention's split partials
    that x's rows are merged from in the kernel (`int4_gemv_merge`; x is then the scratch they go to)."""
    m = x.shape[0]
    nt, ks, tn, _ = codes.shape
    if m > ws.shape[0] or mode not in (1, 2):
        raise ValueError(f"int4_gemv_reduced takes up to {ws.shape[0]} rows and mode 1 or 2, got {m} rows, mode {mode}")
    if silu and (residual is not None or next_weight is not None or not silu_pairs(n, tn)):
        raise ValueError(f"the SiLU epilogue takes no residual or next weight, and N a multiple of 2 x {tn} rows; "
                         f"got N={n}")
    for name, t, width in (("residual", residual, n), ("rms_of", rms_of, k)):
        if t is not None and (t.shape != (m, width) or t.stride() != (width, 1)):
            raise ValueError(f"int4_gemv_epilogue: {name} must be contiguous ({m}, {width}), got {tuple(t.shape)}")
    warps, _, stages = gemv_config(n, k, 132, tn)
    width = n // 2 if silu else n  # y's columns
    y = torch.empty((m, width), device=x.device, dtype=dtype)
    if codes_out and (width % 64 or tn % 32):
        raise ValueError(f"codes out of the epilogue take N (N / 2 with silu) a multiple of 64 and tiles of a "
                         f"multiple of 32 rows, got {width} and {tn}")
    if codes_out and (silu or next_weight is not None):
        xg = torch.empty((m, act8_width(width, bits)), device=x.device, dtype=torch.int8)
    else:
        xg = None if next_weight is None else torch.empty((m, n), device=x.device, dtype=dtype)
    part = ws if mode == 1 or split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    steps = -(-ks // split)
    # the columns of h a load for NORM: a program's own split's (the whole row where it has them all, and in MODE 2's
    # pass of the last program over the row), at most NORM_BLOCK
    hb = min(triton.next_power_of_2(ks * 64 if mode == 2 else steps * 64), NORM_BLOCK)
    rope_args = {}
    if rope is not None:
        cos, sin, positions, kc, vc, n_heads = rope
        hd, n_kv = kc.shape[3], kc.shape[1]
        if (silu or residual is not None or next_weight is not None or hd & (hd - 1) or tn % hd
                or n != (n_heads + 2 * n_kv) * hd or kc.stride(3) != 1 or vc.stride(3) != 1
                or cos.shape != (m, hd) or cos.stride(1) != 1 or sin.stride() != cos.stride()
                or positions.shape != (m,) or kc.shape[0] < m or vc.shape[:2] != kc.shape[:2]):
            raise ValueError(f"the RoPE epilogue takes N = (heads + 2 KV heads) x head_dim rows in tiles of whole "
                             f"heads, unit-stride caches (B, KV, L, hd) and cos / sin (M, hd); got N={n}, tiles of "
                             f"{tn}, caches {tuple(kc.shape)}, cos {tuple(cos.shape)}")
        rope_args = dict(cos_ptr=cos, sin_ptr=sin, pos_ptr=positions, kc_ptr=kc, vc_ptr=vc, s_cs=cos.stride(0),
                         s_p=positions.stride(0), skc_b=kc.stride(0), skc_h=kc.stride(1), skc_s=kc.stride(2),
                         svc_b=vc.stride(0), svc_h=vc.stride(1), svc_s=vc.stride(2), NH=n_heads, NKV=n_kv, ROPE=True,
                         HD=hd)
    merge_args = {}
    if merge is not None:
        mo, mm, ml = merge
        if (act8 or mo.dim() != 4 or mo.shape[0] != m or mo.shape[1] * mo.shape[3] != k or not mo.is_contiguous()
                or mm.shape != mo.shape[:3] or ml.shape != mm.shape or not mm.is_contiguous() or not ml.is_contiguous()
                or mo.shape[3] & (mo.shape[3] - 1)):
            raise ValueError(f"the merge takes a float x and contiguous partials o (M, heads, splits, head_dim) with "
                             f"heads x head_dim = K ({k}) and a power-of-two head_dim, m and l (M, heads, splits); got "
                             f"o {tuple(mo.shape)}, m {tuple(mm.shape)}, l {tuple(ml.shape)}")
        merge_args = dict(MERGE=True, mo_ptr=mo, mm_ptr=mm, ml_ptr=ml, NSPL=mo.shape[2], MNH=mo.shape[1],
                          BLOCK_S=max(2, triton.next_power_of_2(mo.shape[2])), MHD=mo.shape[3])
    _gemv_reduced_kernel[(m, nt, split)](x, codes, sb, y, part, cnt, m, n, nt, ks, steps, x.stride(0),
                                         GROUP=group_size, TN=tn, SPLIT=split, MODE=mode,
                                         CH=min(REDUCE_CHUNK, triton.next_power_of_2(split)), STAGES=stages,
                                         PREFETCH=PREFETCH, UNROLL=UNROLL, ACT8=act8, ASM=_asm(),
                                         CHAIN=LOOP == "chain", BITS=bits, num_warps=warps,
                                         enable_fp_fusion=FP_FUSION,
                                         res_ptr=residual, g_ptr=next_weight, xg_ptr=xg, h_ptr=rms_of,
                                         ss_ptr=cnt[2 * ws.shape[0]:].view(torch.float32), eps=eps,
                                         PAIR_OFF=ws.shape[0] * nt, RES=residual is not None,
                                         XG=next_weight is not None, NORM=rms_of is not None, SILU=silu, HB=hb,
                                         XQ=codes_out, XQW=xg.stride(0) if codes_out and xg is not None else 0,
                                         **rope_args, **merge_args, **pdl.launch_args(x, m))
    return y, xg


def _float_or_codes(x: Tensor, k: int, bits: int, op: str) -> tuple[Tensor, bool]:
    """An epilogue op's input as `_reduced` takes it: (x, False) for a float x, (its int32 words, True) for its
    ACT8_FORMAT codes (int8), which must be of `bits` bits over K columns."""
    if x.dtype != torch.int8:
        return x, False
    if act8_bits(x.shape[1], k) != bits:
        raise ValueError(f"{op}: the activation's codes are not of {bits} bits")
    return x.view(torch.int32), True


# The GEMV's epilogues (`int4_gemv_epilogue`, partition.model.GEMV_EPILOGUES): what the decode step's small kernels
# between the GEMVs did, done by the program that finishes a tile (it holds the tile's whole sum): the residual add
# after o_proj and down_proj (and the next RMSNorm's input h * weight), the RMSNorm's scale before qkv and gate/up
# (x = h * weight goes in, the sum comes out times 1 / rms(h); the tile's programs add up h's sum of squares beside
# their partials), and SiLU(gate) * up after gate/up. A Llama layer's decode step then runs 7 kernels instead of 10.
# Measured on an H100 (docs/BENCHMARKS.md, twentieth session): Llama-3-8B INT4 step +0.2-1.7 %, the SmolLM2-135M
# shape +6.7-7.5 %.


@torch.library.custom_op("orin_agent::int4_gemv_epilogue", mutates_args=())
def int4_gemv_epilogue(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
                       split: int, mode: int, residual: Tensor | None, next_weight: Tensor | None,
                       rms_of: Tensor | None, eps: float, silu: bool) -> tuple[Tensor, Tensor]:
    """x (M, K) @ W^T as int4_gemv_reduced, then, in the kernel: times 1 / sqrt(mean(rms_of^2) + eps) where rms_of
    (M, K) is given (x being rms_of times a norm's weight); plus residual (M, N) where given; with silu, W's rows
    are [gates; ups] and y is silu(gate) * up (M, N / 2), else y (M, N), in x's dtype. The second output is y *
    next_weight (N,) (the next RMSNorm's input) where next_weight is given, else an empty tensor."""
    y, xg = _reduced(x, False, x.shape[1], codes, sb, ws, cnt, n, group_size, split, mode, x.dtype, residual,
                     next_weight, rms_of, eps, silu)
    return y, (x.new_empty((0,)) if xg is None else xg)


@int4_gemv_epilogue.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int, split: int, mode: int,
      residual: Tensor | None, next_weight: Tensor | None, rms_of: Tensor | None, eps: float,
      silu: bool) -> tuple[Tensor, Tensor]:
    m = x.shape[0]
    return x.new_empty((m, n // 2 if silu else n)), x.new_empty((0,) if next_weight is None else (m, n))


@torch.library.custom_op("orin_agent::int4_gemv_epilogue_a8", mutates_args=())
def int4_gemv_epilogue_a8(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
                          split: int, mode: int, residual: Tensor | None, next_weight: Tensor | None,
                          rms_of: Tensor | None, eps: float, silu: bool, bits: int,
                          dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`int4_gemv_epilogue` for a step whose GEMVs take quantised activations (ACT "int8" / "int16", `bits`): x (M, K)
    in a float dtype or as ACT8_FORMAT codes (int8, as its width says); y in dtype; the second output is the codes
    the next GEMV takes instead of a float tensor: of y * next_weight where next_weight is given, or with silu of y
    itself (M, act8_width(N or N / 2, bits)); else empty. So the producer of every GEMV input but the attention's
    writes its codes, and no quantise launch is left between the layer's GEMVs."""
    k = codes.shape[1] * 64
    y, xg = _reduced(*_float_or_codes(x, k, bits, "int4_gemv_epilogue_a8"), k, codes, sb, ws, cnt, n, group_size,
                     split, mode, dtype, residual, next_weight, rms_of, eps, silu, bits, codes_out=True)
    return y, (x.new_empty((0,), dtype=torch.int8) if xg is None else xg)


@int4_gemv_epilogue_a8.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int, split: int, mode: int,
      residual: Tensor | None, next_weight: Tensor | None, rms_of: Tensor | None, eps: float, silu: bool, bits: int,
      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    m, width = x.shape[0], n // 2 if silu else n
    xg = (m, act8_width(width, bits)) if silu or next_weight is not None else (0,)
    return x.new_empty((m, width), dtype=dtype), x.new_empty(xg, dtype=torch.int8)


# The decode attention's merge in o_proj's GEMV (`int4_gemv_merge`, partition.model.MERGE_IN_O, opt-in): each program
# merges the attention's split partials for its own columns (kernels.kv_triton.dense_decode_partials' output) before
# its loop, instead of kernels.kv_triton's merge kernel a launch earlier. A Llama layer's decode step: 6 kernels.


@torch.library.custom_op("orin_agent::int4_gemv_merge", mutates_args=())
def int4_gemv_merge(o: Tensor, m: Tensor, l: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int,
                    group_size: int, split: int, mode: int, residual: Tensor | None, next_weight: Tensor | None,
                    bits: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """o_proj's decode step from the decode attention's split partials o (M, H, S, hd), m and l (M, H, S) fp32: x,
    the merged attention output (M, H hd) in dtype, is made inside the GEMV; then `int4_gemv_epilogue`'s residual and
    next-weight epilogue. bits 0: the second output is y * next_weight in dtype; 8 or 16: its ACT8_FORMAT codes
    (`int4_gemv_epilogue_a8`); empty without next_weight."""
    k = o.shape[1] * o.shape[3]
    x = torch.empty((o.shape[0], k), device=o.device, dtype=dtype)  # every element written by the kernel first
    y, xg = _reduced(x, False, k, codes, sb, ws, cnt, n, group_size, split, mode, dtype, residual, next_weight,
                     bits=bits or 8, codes_out=bool(bits), merge=(o, m, l))
    return y, (x.new_empty((0,), dtype=torch.int8 if bits else dtype) if xg is None else xg)


@int4_gemv_merge.register_fake
def _(o: Tensor, m: Tensor, l: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
      split: int, mode: int, residual: Tensor | None, next_weight: Tensor | None, bits: int,
      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows = o.shape[0]
    xg = (0,) if next_weight is None else (rows, act8_width(n, bits)) if bits else (rows, n)
    return o.new_empty((rows, n), dtype=dtype), o.new_empty(xg, dtype=torch.int8 if bits else dtype)


# RoPE and the K/V cache write in the q/k/v GEMV's epilogue (`int4_gemv_rope`, partition.model.ROPE_EPILOGUE): the
# program that finishes a tile of whole heads rotates them and writes k and v into the caches, as
# kernels.rope_triton's kernel did a launch later. A Llama layer's decode step: 6 kernels instead of 7.


@torch.library.custom_op("orin_agent::int4_gemv_rope", mutates_args=("k_cache", "v_cache"))
def int4_gemv_rope(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
                   split: int, mode: int, rms_of: Tensor | None, eps: float, cos: Tensor, sin: Tensor,
                   positions: Tensor, k_cache: Tensor, v_cache: Tensor, n_heads: int, bits: int,
                   dtype: torch.dtype) -> Tensor:
    """A decode step's fused q/k/v GEMV, x (M, K) @ W^T (times 1 / rms(rms_of) where given, as
    `int4_gemv_epilogue`), with RoPE and the cache write in its epilogue: y (M, N) in dtype, N = (n_heads + 2 KV)
    head_dim, whose first n_heads head_dim columns are q rotated (the rest k and v, unrotated); k rotated and v
    written into k_cache / v_cache (B, KV, L, hd), row m at slot positions[m]; cos / sin (M, hd). x in a float
    dtype, or the ACT8_FORMAT codes of `bits` bits (int8) where the GEMVs take quantised activations. The same
    values as the GEMV followed by kernels.rope_triton.rope_write."""
    k = codes.shape[1] * 64
    y, _ = _reduced(*_float_or_codes(x, k, bits, "int4_gemv_rope"), k, codes, sb, ws, cnt, n, group_size, split,
                    mode, dtype, rms_of=rms_of, eps=eps, bits=bits,
                    rope=(cos, sin, positions, k_cache, v_cache, n_heads))
    return y


@int4_gemv_rope.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int, split: int, mode: int,
      rms_of: Tensor | None, eps: float, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
      v_cache: Tensor, n_heads: int, bits: int, dtype: torch.dtype) -> Tensor:
    return x.new_empty((x.shape[0], n), dtype=dtype)


def _asm() -> bool:
    """Whether kernels may use inline PTX (dp4a): not in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


# How the GEMV (M <= GEMV_MAX_M, in-kernel split-K sum) takes its activation: "exact" (in its own dtype, one fp32
# FMA a weight, products exact) or "int8" (quantised per 32-column block as llama.cpp's CUDA
# mat-vec kernels quantise theirs, to Q8_1: `act8_quant`, then four weights a dp4a instruction, `int4_gemv_a8`).
# "int8" costs a quantise (its own small kernel, or inside the kernel that makes the activation: kernels.norm_triton's
# `_a8` ops, partition.model.ACT8_FUSED) and an activation rounded to 8 bits per block (relative error ~1/254 of the
# block's largest value a column, against bf16's 2^-9 of each value; SmolLM2's greedy tokens 93.5 % those of exact
# activations, docs/BENCHMARKS.md): opt-in. "int16": the same path with int16 codes on a power-of-two scale a block
# (`act8_store` BITS 16), two dp4a a word of weights (8 weights), 1.46 loop instructions a weight on sm_90 against
# 3.00 exact and 1.07 int8 (scripts/int4_kernel_sass.py); a bf16 value within 2^7 of its block's largest is taken
# exactly, a smaller one within 2^-15 of the largest (SmolLM2's greedy tokens, emulated in fp32: 99.91 % those of
# the float model, bf16 activations 99.16 %, int8 93.5 %). Either mode's codes come from the GEMV epilogues
# (`int4_gemv_epilogue_a8`) or the norms (kernels.norm_triton), one quantise launch a step more than "exact".
# "auto", the default (`act_mode`): "int16" for a bf16 or fp16 model, "exact" for an fp32 one (whose activations
# int16 codes would round). Measured on an H100 (docs/BENCHMARKS.md, twenty-fourth session): the Llama-3-8B INT4
# decode step with an INT4 head 1.3-10.3 % faster with int16 than exact in three runs (388.3 against 369.1 tok/s
# in the run beside gpt-fast), with a bf16 head +3.0 %; the SmolLM2-135M shape (fp16, g32) +4-15 % with PDL on, and
# 24-27 % slower than exact without it (so PDL's "auto" keeps it on for int16, `_int8_activations`).
ACT_MODES = ("auto", "exact", "int8", "int16")
ACT = os.environ.get("ORIN_AGENT_INT4_ACT", "auto")
if ACT not in ACT_MODES:
    raise ValueError(f"ORIN_AGENT_INT4_ACT={ACT!r}: use one of {', '.join(ACT_MODES)}")
ACT8_BLOCKS = 32  # 32-column blocks an `_act8_kernel` program quantises


@pdl.measured_slower
def _int8_activations() -> bool:
    """With int8 activations the decode step measured 2.5-7 % slower with PDL on an H200 (kernels.pdl). Not int16
    ones: with them PDL measured -1 to +5 % on the Llama-3-8B step and +27-40 % on SmolLM2's (H100, twenty-fourth
    session)."""
    return ACT == "int8"


def act_mode(dtype: torch.dtype) -> str:
    """How the GEMV takes the activations of a model of float `dtype`: ACT, with "auto" resolved ("int16" for
    bf16 / fp16, "exact" otherwise)."""
    if ACT != "auto":
        return ACT
    return "int16" if dtype in (torch.bfloat16, torch.float16) else "exact"


def act_bits(dtype: torch.dtype) -> int:
    """The bits of a quantised activation's codes for a model of float `dtype` (8 where `act_mode` is "exact":
    the format's default)."""
    return 16 if act_mode(dtype) == "int16" else 8


def act8_width(k: int, bits: int = 8) -> int:
    """Bytes of one ACT8_FORMAT row of K columns: K codes (bits 16: K high bytes, K low bytes), then (d, sum) fp32
    for each of the K / 32 blocks."""
    return k * (bits // 8) + k // 4


# ACT8_FORMAT: an activation row of K columns (K a multiple of 64) as int8 (M, act8_width(K)): bytes [0, K) the
# codes, block by block, byte 16 p + 4 j + c of block b holding column 32 b + 8 c + 4 p + j (the columns that the
# even (p = 0) and odd (p = 1) nibbles of the layout's word j hold, so that one dp4a multiplies four of them); then
# K / 32 pairs (d, sum of x) in fp32. With 16 bits (ACT "int16") bytes [0, K) are the codes' high bytes (signed),
# [K, 2K) their low bytes (unsigned) in the same order, then the pairs. One tensor, so a producer
# (kernels.norm_triton) can hand it to QuantLinear in place of x.
ACT8_FORMAT = "int8 codes + (d, sum) fp32 per 32-column block"


@torch.library.custom_op("orin_agent::int4_act8", mutates_args=())
def act8_quant(x: Tensor, bits: int = 8, weight: Tensor | None = None) -> Tensor:
    """x (M, K), K a multiple of 64 -> its ACT8_FORMAT rows of 8- or 16-bit codes, int8 (M, act8_width(K, bits))
    (`_act8_kernel`). weight (K,): the codes of (x.float() * weight.float()).to(x.dtype) instead, in the same launch
    (a decode step's first q/k/v input: the embedding times the first norm's weight; four torch kernels fewer)."""
    m, k = x.shape
    if k % 64 or bits not in (8, 16):
        raise ValueError(f"act8_quant takes K a multiple of 64 and 8 or 16 bits, got K={k}, {bits} bits")
    if weight is not None and (weight.shape != (k,) or weight.stride(0) != 1):
        raise ValueError(f"act8_quant's weight must be contiguous ({k},), got {tuple(weight.shape)}")
    q = torch.empty((m, act8_width(k, bits)), device=x.device, dtype=torch.int8)
    _act8_kernel[(m, triton.cdiv(k // 32, ACT8_BLOCKS))](x, q, k, x.stride(0), q.stride(0), NB=ACT8_BLOCKS,
                                                         BITS=bits, w_ptr=x if weight is None else weight,
                                                         HAS_W=weight is not None, num_warps=4,
                                                         **pdl.launch_args(x, m))
    return q


@act8_quant.register_fake
def _(x: Tensor, bits: int = 8, weight: Tensor | None = None) -> Tensor:
    return x.new_empty((x.shape[0], act8_width(x.shape[1], bits)), dtype=torch.int8)


def act8_bits(width: int, k: int) -> int:
    """The code bits of an ACT8_FORMAT row of `width` bytes over K columns (K a multiple of 64)."""
    for bits in (8, 16):
        if width == act8_width(k, bits):
            return bits
    raise ValueError(f"{width} bytes is no ACT8_FORMAT row of K={k} columns ({act8_width(k)} with 8-bit codes, "
                     f"{act8_width(k, 16)} with 16-bit ones)")


def act8_unpack(q: Tensor, bits: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    """An ACT8_FORMAT activation (M, width) of `bits`-bit codes -> (codes (M, K) in column order: int8, or int32 for
    16 bits, d (M, K / 32), sums (M, K / 32)) (tests, tools)."""
    m = q.shape[0]
    k = (q.shape[1] * 4) // (bits // 2 + 1)
    if act8_width(k, bits) != q.shape[1] or k % 64:
        raise ValueError(f"{q.shape[1]} bytes is no ACT8_FORMAT row of {bits}-bit codes")

    def order(b: Tensor) -> Tensor:  # (b, p, j, c) -> (b, c, p, j)
        return b.reshape(m, k // 32, 2, 4, 4).permute(0, 1, 4, 2, 3).reshape(m, k)

    codes = order(q[:, :k])
    if bits == 16:
        codes = codes.int() * 256 + order(q[:, k:2 * k]).view(torch.uint8).int()
    xd = q[:, k * bits // 8:].contiguous().view(torch.float32).reshape(m, k // 32, 2)
    return codes, xd[..., 0], xd[..., 1]


@torch.library.custom_op("orin_agent::int4_gemv_a8", mutates_args=())
def int4_gemv_a8(q: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
                 split: int, mode: int, dtype: torch.dtype) -> Tensor:
    """An ACT8_FORMAT activation q (M, width) of x (M, K) @ W^T -> (M, N) in dtype on dp4a (8- or 16-bit codes, as
    q's width says), the split-K sum in the kernel as int4_gemv_reduced's (same scratch)."""
    k = codes.shape[1] * 64
    bits = act8_bits(q.shape[1], k)
    return _reduced(q.view(torch.int32), True, k, codes, sb, ws, cnt, n, group_size, split, mode, dtype,
                    bits=bits)[0]


@int4_gemv_a8.register_fake
def _(q: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int,
      split: int, mode: int, dtype: torch.dtype) -> Tensor:
    return q.new_empty((q.shape[0], n), dtype=dtype)


@int4_gemv_reduced.register_fake
def _(x: Tensor, codes: Tensor, sb: Tensor, ws: Tensor, cnt: Tensor, n: int, group_size: int, split: int,
      mode: int) -> Tensor:
    return x.new_empty((x.shape[0], n))


def linear(x2: Tensor, codes: Tensor, sb: Tensor, n: int, group_size: int, split: int,
           ws: Tensor | None = None, cnt: Tensor | None = None) -> Tensor:
    """x2 (M, K) @ W^T -> (M, N) in x2's dtype: the GEMV for M <= GEMV_MAX_M (split-K summed as REDUCE
    says; "partials" where no scratch is given; the activation taken as ACT says where the sum is in the
    kernel), else as PREFILL says (`prefill_fused`): the fused `int4_mm`, or dequantise once and F.linear (cuBLAS /
    inductor's mm; "graphed": the dequantise replayed from a CUDA graph)."""
    if x2.shape[0] > GEMV_MAX_M:
        if prefill_fused(x2.shape[0], x2.dtype):
            return int4_mm(x2.contiguous(), codes, sb, n, group_size)
        dequant = dequant_graphed if PREFILL == "graphed" else int4_dequant
        return torch.nn.functional.linear(x2, dequant(codes, sb, n, group_size, x2.dtype))
    if REDUCE != "partials" and ws is not None and cnt is not None:
        if act_mode(x2.dtype) != "exact":
            return int4_gemv_a8(act8_quant(x2.contiguous(), act_bits(x2.dtype)), codes, sb, ws, cnt, n, group_size,
                                split, REDUCE_MODES[REDUCE], x2.dtype)
        return int4_gemv_reduced(x2.contiguous(), codes, sb, ws, cnt, n, group_size, split, REDUCE_MODES[REDUCE])
    partial = int4_gemv(x2.contiguous(), codes, sb, n, group_size, split)
    return (partial[0] if split == 1 else partial.sum(0)).to(x2.dtype)
