"""Triton GPU kernels for the INT8 KV-cache: quantise-on-write, and decode attention (one new token per
row) over the INT8 cache with INT8 reads, FP32 accumulation and an online softmax, split along the
sequence (flash-decoding) so that a batch of 1 still fills the GPU. `kernels.kv_quant` is the plain-
PyTorch reference of both (`quantize`, `attention_reference`); tests/test_kv_triton.py compares them.

Layouts are kernels.kv_quant's: cache int8 (B, KV, S, hd), scales fp16 (B, KV, S, hd / G). The INT8
attention kernel never dequantises element by element: the dot's rows are (query head, channel group)
pairs, so the group scales apply to per-group partial scores and to the probabilities, and the int8
tiles only go through an int8 -> fp16 conversion (in PTX on packed bytes on CUDA). An FP16 kernel of the
same structure reads an FP16 cache (`k_scale=None`) for the benchmark (scripts/bench_kv_gpu.py). A
second kernel merges the splits and, in the model, the step's own unquantised K/V (`Int8DecodePast`,
what partition.runners.torch_runner uses on CUDA). V is read token-tiled (Int8KVCache(token_tile=16),
V_TOKEN_TILE): as P @ V's operand, reduced over slots, a row-major int8 V is a byte gather from shared
memory. Measured on an H200 (docs/BENCHMARKS.md): 1.33-1.36x the best FP16 decode attention at batch 8
and 16k-32k context, 1.06-1.13x at batch 1; 1.45-1.50x at batch 8 with `qk_int8` (q quantised, Q.K on
the int8 tensor cores; opt-in, it changes numerics). Issue-bound (0.64 warps issued per scheduler per
cycle), not bandwidth-bound. Formulations that lost there: head_dim in 4 chunks of one group each (0.63-0.87x FP16:
255 registers per thread) and dequantising to fp16 before FP16-style dots (0.72x the row layout).

Why Triton rather than CUDA C++ through torch's extension loader: no host compiler or CUDA toolkit at
run time, the kernel is JIT-compiled for the GPU it finds, and it runs on CPU in Triton's interpreter
(TRITON_INTERPRET=1) for tests without a GPU.

Orin (sm_87): the target is not the problem (Triton emits PTX through its own LLVM and assembles it
with the ptxas it bundles, for any Ampere-or-later capability: `scripts/kv_kernel_sass.py --arch 87`
compiles these kernels for sm_87 on a machine without a GPU); the toolchain is. JetPack ships no
Triton, NVIDIA's JetPack PyTorch wheels do not pull one in, and PyPI's aarch64 wheels are built for
server (SBSA) CUDA, not L4T: Jetson users build Triton from source (triton-lang/triton#5498; the
JetPack 7.2 image of roboflow/inference#2531 builds it from source for Orin sm_87 and Thor). So: not
verified on a board here; until it is, the CPU/PyTorch path (kernels.kv_quant) is what runs on Orin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.kv_quant import Int8KVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference in kernels.kv_quant is the path
    triton = None
    tl = None

from kernels import pdl

BLOCK_H = 16  # query heads of one KV head, padded to tl.dot's smallest M
# The fewest cache slots a decode split takes (decode_attention's default split count; read at each call): one
# BLOCK_N tile. 256 was the optimum of a sweep at 16k slots (INT8 cache, where 8 waves of programs bind first;
# docs/BENCHMARKS.md), but at a Llama-3-8B step's ~600 slots it left 3 splits, 24 programs for 8 KV heads on a
# 132-SM GPU, each reading its 256 slots in 4 dependent steps. At 64: the whole INT4 step 311.0 / 310.5 -> 324.0 /
# 324.5 tok/s (H100, bench_cuda_decode.py, interleaved, 2026-12-07, docs/BENCHMARKS.md "Twentieth session").
SPLIT_MIN_SLOTS = 64
# The V cache's token tile for the decode kernel (Int8KVCache(token_tile=...)): 16 slots of a channel in
# one 16-byte run, the width of one async copy. 4 / 8 / 16 / 32 measured on an H200 (docs/BENCHMARKS.md).
V_TOKEN_TILE = 16


def available() -> bool:
    return triton is not None


if triton is not None:
    from kernels.rope_triton import cos_sin, rotate  # defined only where Triton is

    @triton.jit
    def _quantize_write_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, starts_ptr,
                               sx_b, sx_h, sx_t, sq_b, sq_h, sq_s, ss_b, ss_h, ss_s,
                               KV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, N_GROUPS: tl.constexpr,
                               TILE: tl.constexpr):
        """TILE > 1: the int8 values are token-tiled (Int8KVCache(token_tile=TILE)): slot s, channel d at
        (s // TILE) * sq_s + d * TILE + s % TILE of the (b, head) plane, sq_s = hd * TILE."""
        pid = tl.program_id(0)  # one (b, kv head, t) per program, all groups of it
        b = pid // (KV * T)
        h = (pid // T) % KV
        t = pid % T
        row = tl.load(rows_ptr + b)
        slot = tl.load(starts_ptr + b) + t
        offs = tl.arange(0, N_GROUPS)[:, None] * G + tl.arange(0, G)[None, :]  # (N_GROUPS, G)
        x = tl.load(x_ptr + b * sx_b + h * sx_h + t * sx_t + offs).to(tl.float32)
        # IEEE divisions (Triton's `/` is an approximate one on CUDA) and round-half-to-even, as
        # torch.round: the codes and scales equal kernels.kv_quant.quantize's bit for bit.
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)).to(tl.float16)  # (N_GROUPS,)
        s32 = scale.to(tl.float32)
        safe = tl.where(s32 > 0, s32, 1.0)
        y = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # a tie to the even side
        q = tl.minimum(tl.maximum(r, -127.0), 127.0)
        if TILE > 1:
            q_off = (slot // TILE) * sq_s + offs * TILE + slot % TILE
        else:
            q_off = slot * sq_s + offs
        tl.store(q_ptr + row * sq_b + h * sq_h + q_off, q.to(tl.int8))
        tl.store(s_ptr + row * ss_b + h * ss_h + slot * ss_s + tl.arange(0, N_GROUPS), scale)

    @triton.jit
    def _online_softmax(s, m_i, l_i):
        """One block of scores s (rows, BLOCK_N) into the running max m_i and sum l_i: returns the new max,
        the rescale factor of the old accumulator, the block's probabilities and the new sum. A row that
        has seen only masked slots (-inf) keeps m = -inf and gets p = 0, alpha = 0 (no NaN)."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _split_bounds(len_ptr, split_len):
        """This program's query row, KV head and sequence split, and the split's slots [lo, hi): the loop
        stops at the row's length, so splits past it only write an empty partial (m = -inf)."""
        b = tl.program_id(0)
        sp = tl.program_id(2)
        lo = sp * split_len
        return b, tl.program_id(1), sp, lo, tl.minimum(lo + split_len, tl.load(len_ptr + b))

    @triton.jit
    def _store_partial(o_ptr, m_ptr, l_ptr, acc, m_i, l_i, b, kvh, sp, so_b, so_h, so_sp, sm_b, sm_h,
                       HPK: tl.constexpr, ROWS: tl.constexpr, HD: tl.constexpr):
        """A split's partial output (ROWS, HD), max and sum for the merge kernel; rows past HPK are padding."""
        offs_h = tl.arange(0, ROWS)
        offs_d = tl.arange(0, HD)
        h_ok = offs_h < HPK
        heads = kvh * HPK + offs_h
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + sp * so_sp + offs_d[None, :], acc, mask=h_ok[:, None])
        tl.store(m_ptr + b * sm_b + heads * sm_h + sp, m_i, mask=h_ok)
        tl.store(l_ptr + b * sm_b + heads * sm_h + sp, l_i, mask=h_ok)

    @triton.jit
    def _int8_to_fp16(x, CVT: tl.constexpr):
        """int8 -> fp16, exactly. CVT 0: the conversion instruction (a quarter of the FP32 rate on Hopper,
        one element each). CVT 1 and 2 go through the bits instead: x + 128 as a byte under the exponent
        of 1024.0 (0x64) is the fp16 number 1024 + x + 128, and one fp16 subtraction of 1152 leaves x
        (the trick of FasterTransformer's and Marlin's dequantisers); 1 in plain Triton (integer ops on
        each element), 2 in PTX on four packed bytes at once (one xor, two byte permutes, two
        sub.f16x2: five instructions for four values; CUDA only)."""
        if CVT == 2:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, m;
                xor.b32 t, $2, 0x80808080;
                prmt.b32 $0, t, 0x64646464, 0x4140;
                prmt.b32 $1, t, 0x64646464, 0x4342;
                mov.b32 m, 0x64806480;
                sub.f16x2 $0, $0, m;
                sub.f16x2 $1, $1, m;
                }""",
                constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)
        elif CVT == 1:
            u = (x.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400
            return u.to(tl.float16, bitcast=True) - tl.full((1, 1), 1152.0, tl.float16)
        else:
            return x.to(tl.float16)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, rows_ptr, o_ptr, m_ptr, l_ptr,
                             sq_b, sq_h, sk_b, sk_h, sk_s, so_b, so_h, so_sp, sm_b, sm_h, sm_scale, split_len,
                             HPK: tl.constexpr, HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_ROWS: tl.constexpr = True, PDL: tl.constexpr = False, kn_ptr=None, vn_ptr=None,
                             cos_ptr=None, sin_ptr=None, sn_b=0, sc_b=0, ROPE: tl.constexpr = False):
        """FP16 / BF16 cache: one (row, KV head, split) per program, its HPK query heads as the rows of tl.dot.
        The dots take fp16 operands with fp32 accumulation: a bf16 value within fp16's range (|x| < 65504, the
        normal range from 6e-5) converts exactly (8 significant bits into 11), the probabilities keep 3 bits
        more than bf16 would; Triton's interpreter also runs only this form (its bf16 tl.dot returns garbage).
        PDL: kernels.pdl.
        ROPE: q is the projection's, unrotated, and the step's own token is not in the caches yet: each program
        rotates its query heads (kernels.rope_triton's formula, rounded to the cache's dtype as rope_write
        rounds them), and the program whose split holds the token's slot (lengths[b] - 1) first rotates its k
        (kn, row stride sn_b) into the K cache and copies its v (vn) into the V cache there, as rope_write
        does, then reads them back with the rest of its split after a barrier. cos / sin: (B, HD), row stride
        sc_b. Needs HAS_ROWS False (query row b writes cache row b)."""
        pdl.start(PDL)
        b, kvh, sp, lo, hi = _split_bounds(len_ptr, split_len)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HD)
        h_ok = offs_h < HPK
        if ROPE:
            half = tl.arange(0, HD // 2)
            c1, c2, s1, s2 = cos_sin(cos_ptr, sin_ptr, b * sc_b, HD)
            src = q_ptr + b * sq_b + (kvh * HPK + offs_h)[:, None] * sq_h + half[None, :]
            r1, r2 = rotate(tl.load(src, mask=h_ok[:, None], other=0.0).to(tl.float32),
                            tl.load(src + HD // 2, mask=h_ok[:, None], other=0.0).to(tl.float32),
                            c1[None, :], c2[None, :], s1[None, :], s2[None, :])
            q = tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_H, HD))  # the halves side by side
            q = q.to(k_ptr.dtype.element_ty).to(tl.float16)
            slot = hi - 1  # the token's slot, lengths[b] - 1, where this split holds it
            if (slot >= lo) & (hi == tl.load(len_ptr + b)):
                dst = b * sk_b + kvh * sk_h + slot.to(tl.int64) * sk_s
                kn = kn_ptr + b * sn_b + kvh * HD + half
                k1, k2 = rotate(tl.load(kn).to(tl.float32), tl.load(kn + HD // 2).to(tl.float32), c1, c2, s1, s2)
                tl.store(k_ptr + dst + half, k1.to(k_ptr.dtype.element_ty))
                tl.store(k_ptr + dst + HD // 2 + half, k2.to(k_ptr.dtype.element_ty))
                vn = tl.load(vn_ptr + b * sn_b + kvh * HD + offs_d)
                tl.store(v_ptr + dst + offs_d, vn.to(v_ptr.dtype.element_ty))
                tl.debug_barrier()  # the writes visible to every thread of the program before its loop reads them
        else:
            q = tl.load(q_ptr + b * sq_b + (kvh * HPK + offs_h)[:, None] * sq_h + offs_d[None, :],
                        mask=h_ok[:, None], other=0.0).to(tl.float16)  # (BLOCK_H, HD)
        m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, HD), tl.float32)
        if HAS_ROWS:
            row = tl.load(rows_ptr + b)  # the cache row of query row b
        else:  # query row b reads cache row b (no rows tensor: one kernel fewer a layer)
            row = b
        kbase = row * sk_b + kvh * sk_h
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            kv_off = kbase + offs_n[:, None] * sk_s + offs_d[None, :]  # (BLOCK_N, HD)
            k = tl.load(k_ptr + kv_off, mask=n_ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * sm_scale  # (BLOCK_H, BLOCK_N), fp32 accumulate
            s = tl.where(n_ok[None, :], s, -float("inf"))
            m_i, alpha, p, l_i = _online_softmax(s, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        _store_partial(o_ptr, m_ptr, l_ptr, acc, m_i, l_i, b, kvh, sp, so_b, so_h, so_sp, sm_b, sm_h, HPK, BLOCK_H, HD)

    @triton.jit
    def _decode_split_int8_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, rows_ptr, o_ptr, m_ptr, l_ptr,
                                  sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, ss_b, ss_h, ss_s, so_b, so_h,
                                  so_sp, sm_b, sm_h, sm_scale, split_len, HPK: tl.constexpr, HD: tl.constexpr,
                                  G: tl.constexpr, NG: tl.constexpr, BLOCK_R: tl.constexpr,
                                  BLOCK_HH: tl.constexpr, BLOCK_N: tl.constexpr, DENSE_SCALES: tl.constexpr,
                                  CVT: tl.constexpr, V_TILE: tl.constexpr, QK_INT8: tl.constexpr = False,
                                  HAS_ROWS: tl.constexpr = True):
        """INT8 cache with no per-element dequantisation: row r = h * NG + g of the dot holds query head h
        masked to channel group g, so Q' @ K8^T gives each group's partial score, which is scaled by that
        slot's K scale and summed over the NG rows of a head. For V, row (h, g) gets p[h] times the V
        scale of group g, P' @ V8 accumulates (BLOCK_R, HD), and at the end head h keeps, of each
        channel, the row of that channel's group. The int8 tiles only go through an int8 -> fp16 cast.
        BLOCK_R = BLOCK_HH * NG >= HPK * NG, BLOCK_R >= 16 (tl.dot's smallest M).
        V_TILE > 1: V is token-tiled (Int8KVCache(token_tile=V_TILE): V_TILE consecutive slots of a channel
        are adjacent bytes, tiles HD * V_TILE bytes apart; sv_s unused), loaded as a (BLOCK_N / V_TILE, HD,
        V_TILE) block and permuted to (BLOCK_N, HD) in registers: V is P @ V's right operand, reduced
        over slots, and row-major int8 makes that operand a byte-wise gather from shared memory (64
        single-byte loads per thread per block); tiled, it is 16-byte async copies and ldmatrix. A tile
        is read whole when its first slot is below the split's end (the cache's capacity is a multiple
        of V_TILE; the extra slots' probabilities and V scales are 0)."""
        b, kvh, sp, lo, hi = _split_bounds(len_ptr, split_len)
        offs_r = tl.arange(0, BLOCK_R)
        h_r = offs_r // NG
        g_r = offs_r % NG
        offs_d = tl.arange(0, HD)
        sel = (offs_d // G)[None, :] == g_r[:, None]  # (BLOCK_R, HD): channel d belongs to row r's group
        qr = tl.load(q_ptr + b * sq_b + (kvh * HPK + h_r)[:, None] * sq_h + offs_d[None, :],
                     mask=(h_r < HPK)[:, None] & sel, other=0.0)  # (BLOCK_R, HD)
        if QK_INT8:  # q quantised per (head, group) row: Q8 @ K8^T on the int8 tensor cores, int32 sums
            q_amax = tl.max(tl.abs(qr.to(tl.float32)), axis=1)
            q_scale = tl.where(q_amax > 0, q_amax / 127.0, 1.0)
            qr = tl.minimum(tl.maximum(tl.floor(qr.to(tl.float32) / q_scale[:, None] + 0.5), -127.0), 127.0).to(tl.int8)
        else:
            qr = qr.to(tl.float16)
        m_i = tl.full((BLOCK_HH,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_HH,), tl.float32)
        acc = tl.zeros((BLOCK_R, HD), tl.float32)
        if HAS_ROWS:
            row = tl.load(rows_ptr + b)  # the cache row of query row b
        else:  # query row b reads cache row b (no rows tensor: one kernel fewer a layer)
            row = b
        kbase = row * sk_b + kvh * sk_h
        vbase = row * sv_b + kvh * sv_h
        sbase = row * ss_b + kvh * ss_h
        offs_b = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_b
            n_ok = offs_n < hi
            kv_off = kbase + offs_n[:, None] * sk_s + offs_d[None, :]  # (BLOCK_N, HD)
            k8 = tl.load(k_ptr + kv_off, mask=n_ok[:, None], other=0)
            if V_TILE > 1:
                # A block's tiles are one contiguous run (tile stride HD * V_TILE, a constant: with the
                # runtime stride every tile needs its own addresses, 30 registers more).
                offs_t = tl.arange(0, BLOCK_N // V_TILE)
                v_tile = (offs_t[:, None, None] * (HD * V_TILE) + offs_d[None, :, None] * V_TILE
                          + tl.arange(0, V_TILE)[None, None, :])
                t_ok = (start + offs_t * V_TILE < hi)[:, None, None]  # whole tiles: the loads stay 16-byte
                v3 = tl.load(v_ptr + vbase + start * HD + v_tile, mask=t_ok, other=0)
                v8 = tl.reshape(tl.permute(v3, (0, 2, 1)), (BLOCK_N, HD))
            else:
                v8 = tl.load(v_ptr + vbase + offs_n[:, None] * sv_s + offs_d[None, :], mask=n_ok[:, None], other=0)
            v = _int8_to_fp16(v8, CVT)
            if QK_INT8:
                part = tl.dot(qr, tl.trans(k8), out_dtype=tl.int32).to(tl.float32) * q_scale[:, None]
            else:  # (BLOCK_R, BLOCK_N): row (h, g) = group g's share of head h's score
                part = tl.dot(qr, tl.trans(_int8_to_fp16(k8, CVT)))
            if DENSE_SCALES:  # one contiguous (BLOCK_N, NG) tile per tensor, spread over rows in registers
                s_off = sbase + offs_n[:, None] * ss_s + tl.arange(0, NG)[None, :]
                ksc = tl.trans(tl.load(ks_ptr + s_off, mask=n_ok[:, None], other=0.0).to(tl.float32))  # (NG, BLOCK_N)
                vsc = tl.trans(tl.load(vs_ptr + s_off, mask=n_ok[:, None], other=0.0).to(tl.float32))
                s = tl.sum(tl.reshape(part, (BLOCK_HH, NG, BLOCK_N)) * ksc[None, :, :], axis=1) * sm_scale
                s = tl.where(n_ok[None, :], s, -float("inf"))  # (BLOCK_HH, BLOCK_N)
                m_i, alpha, p, l_i = _online_softmax(s, m_i, l_i)
                p_r = tl.reshape(p[:, None, :] * vsc[None, :, :], (BLOCK_R, BLOCK_N))
            else:  # gather: the scale of (slot, row's group) for every element of the (BLOCK_R, BLOCK_N) tile
                s_off = sbase + offs_n[None, :] * ss_s + g_r[:, None]
                ksc = tl.load(ks_ptr + s_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                vsc = tl.load(vs_ptr + s_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
                s = tl.sum(tl.reshape(part * ksc, (BLOCK_HH, NG, BLOCK_N)), axis=1) * sm_scale
                s = tl.where(n_ok[None, :], s, -float("inf"))
                m_i, alpha, p, l_i = _online_softmax(s, m_i, l_i)
                p_r = tl.reshape(tl.broadcast_to(p[:, None, :], (BLOCK_HH, NG, BLOCK_N)), (BLOCK_R, BLOCK_N)) * vsc
            a_r = tl.reshape(tl.broadcast_to(alpha[:, None], (BLOCK_HH, NG)), (BLOCK_R,))
            acc = acc * a_r[:, None] + tl.dot(p_r.to(tl.float16), v)
        out = tl.sum(tl.reshape(tl.where(sel, acc, 0.0), (BLOCK_HH, NG, HD)), axis=1)  # (BLOCK_HH, HD)
        _store_partial(o_ptr, m_ptr, l_ptr, out, m_i, l_i, b, kvh, sp, so_b, so_h, so_sp, sm_b, sm_h, HPK, BLOCK_HH, HD)

    @triton.jit
    def split_weights(m, big):
        """The merge's weight of each split, exp(m - big) for its maximum m against the largest, big; 0 for an empty
        split (m = -inf). One formula for the merge kernel and kernels.int4_triton's merge in o_proj's GEMV, so both
        give the same bits."""
        return tl.where(m > -float("inf"), tl.exp(m - big), 0.0)

    @triton.jit
    def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, q_ptr, kn_ptr, vn_ptr, n_splits, sm_scale, sq_b, sq_h, sn_b, sn_h,
                      H: tl.constexpr, HPK: tl.constexpr, HD: tl.constexpr, BLOCK_S: tl.constexpr,
                      HAS_NEW: tl.constexpr, PDL: tl.constexpr = False):
        """One (b, head): out = sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j over the splits (flash-
        decoding's reduction); o (B, H, splits, HD), m and l (B, H, splits), contiguous. HAS_NEW: the
        step's own K/V (B, KV, HD), unquantised, join as one more term, as the reference attention
        concatenates the fresh K/V to the dequantised past. PDL: kernels.pdl."""
        pdl.start(PDL)
        pid = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HD)
        ok = offs_s < n_splits
        m = tl.load(m_ptr + pid * n_splits + offs_s, mask=ok, other=-float("inf"))
        l_s = tl.load(l_ptr + pid * n_splits + offs_s, mask=ok, other=0.0)
        o = tl.load(o_ptr + (pid * n_splits + offs_s)[:, None] * HD + offs_d[None, :], mask=ok[:, None], other=0.0)
        big = tl.max(m, axis=0)
        if HAS_NEW:
            b = pid // H
            kvh = (pid % H) // HPK
            qv = tl.load(q_ptr + b * sq_b + (pid % H) * sq_h + offs_d).to(tl.float32)
            kn = tl.load(kn_ptr + b * sn_b + kvh * sn_h + offs_d).to(tl.float32)
            vn = tl.load(vn_ptr + b * sn_b + kvh * sn_h + offs_d).to(tl.float32)
            s_new = tl.sum(qv * kn, axis=0) * sm_scale
            big = tl.maximum(big, s_new)
            w_new = tl.exp(s_new - big)
        w = split_weights(m, big)
        num = tl.sum(o * w[:, None], axis=0)
        den = tl.sum(l_s * w, axis=0)
        if HAS_NEW:
            num = num + w_new * vn
            den = den + w_new
        tl.store(out_ptr + pid * HD + offs_d, num / den)


def _split_plan(b: int, kv: int, s_max: int, device: torch.device, n_splits: int | None = None, block_n: int = 64,
                waves: float = 8.0) -> tuple[int, int]:
    """decode_attention's (splits, slots a split): by default enough programs for `waves` waves over the SMs, no
    split shorter than SPLIT_MIN_SLOTS; each split a whole number of block_n tiles."""
    if n_splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        n_splits = max(1, min(math.ceil(waves * sms / (b * kv)), math.ceil(s_max / SPLIT_MIN_SLOTS)))
    split_len = math.ceil(s_max / n_splits / block_n) * block_n
    return math.ceil(s_max / split_len), split_len


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed: `pip install triton` (it ships with CUDA builds of torch)")


def quantize_write(fresh: Tensor, q_cache: Tensor, s_cache: Tensor, rows: Tensor, starts: Tensor) -> None:
    """Quantise new K or V (B, KV, T, hd) and write it into cache rows `rows` (B,) at slots
    starts[b] .. starts[b] + T - 1, in place: q_cache int8 (Bmax, KV, S, hd) or token-tiled (Bmax, KV, S / T',
    hd, T') (Int8KVCache(token_tile=T')), s_cache fp16 (Bmax, KV, S, hd / G)."""
    _need_triton()
    b, kv, t, hd = fresh.shape
    n_groups = s_cache.shape[-1]
    tile = q_cache.shape[-1] if q_cache.dim() == 5 else 1
    fresh = fresh.contiguous()
    if fresh.stride(-1) != 1 or q_cache.stride(-1) != 1 or s_cache.stride(-1) != 1 or (
            tile > 1 and q_cache.stride(-2) != tile):
        raise ValueError("the last dim (head_dim / groups / token tile) must be contiguous")
    _quantize_write_kernel[(b * kv * t,)](
        fresh, q_cache, s_cache, rows.to(torch.int32).contiguous(), starts.to(torch.int32).contiguous(),
        fresh.stride(0), fresh.stride(1), fresh.stride(2), q_cache.stride(0), q_cache.stride(1), q_cache.stride(2),
        s_cache.stride(0), s_cache.stride(1), s_cache.stride(2), KV=kv, T=t, G=hd // n_groups, N_GROUPS=n_groups,
        TILE=tile)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None, rows: Tensor | None = None, k_new: Tensor | None = None,
                     v_new: Tensor | None = None, n_splits: int | None = None, block_n: int = 64,
                     num_warps: int = 4, num_stages: int = 3, waves: float = 8.0, dense_scales: bool = True,
                     cvt: int | None = None, qk_int8: bool = False, out_dtype: torch.dtype = torch.float32,
                     merge: bool = True, rope: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
                     ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """q (B, H, hd); k, v (B, KV, S, hd) int8 with scales (B, KV, S, hd / G), or fp16 with no scales;
    lengths (B,) int32: row b attends to slots [0, lengths[b]). Returns (B, H, hd) in `out_dtype` (the merge
    kernel's fp32 result rounded on its store: no cast kernel after it).
    rope (k_proj, v_proj, cos, sin), a dense cache's decode step: q is the projection's output, unrotated, and the
    step's token (at slot lengths[b] - 1) is not in the caches yet; the split kernel rotates q, and writes the
    token's K (rotated) and V into the caches as kernels.rope_triton.rope_write does, in the same launch (k_proj,
    v_proj (B, KV * hd), cos / sin (B, hd) at the model's dtype, unit stride along hd; no `rows`).
    An INT8 v may be token-tiled, (B, KV, S / T, hd, T) (Int8KVCache(token_tile=T).q): the fast layout.
    rows (B,): the cache row of each query row (default 0..B-1; the cache may have more rows).
    k_new, v_new (B, KV, hd): the step's own K/V, attended unquantised besides the cache's slots.

    The sequence is cut into `n_splits` pieces (default: enough programs for `waves` waves over the
    SMs); each gives a partial max, sum and output, merged by a second kernel (flash-decoding's
    reduction). `block_n`, `num_warps`, `num_stages`: the split kernel's tile and launch settings;
    `dense_scales`, `cvt`: the INT8 kernel's scale loads and int8 -> fp16 conversion (`_int8_to_fp16`;
    default 2, the PTX one, on CUDA and 1 elsewhere, i.e. in Triton's interpreter); the simpler variants
    are there for the GPU benchmark to measure against. merge False: the splits' partials (o (B, H, S, hd), m and l
    (B, H, S), fp32) instead of the merged output, for a consumer that merges them itself (no k_new / v_new).
    Defaults: the INT8 kernel's best settings in the sweep on an H200 (docs/BENCHMARKS.md)."""
    _need_triton()
    b, h, hd = q.shape
    kv, s_max = k.shape[1], k.shape[2]
    hpk = h // kv
    if hpk > BLOCK_H or hd & (hd - 1):
        raise ValueError(f"needs <= {BLOCK_H} query heads per KV head and a power-of-two head_dim")
    is_int8 = k_scale is not None
    if rope is not None and (is_int8 or rows is not None or k_new is not None or k.stride() != v.stride()
                             or any(x.stride(-1) != 1 for x in rope) or rope[0].stride(0) != rope[1].stride(0)
                             or rope[2].stride(0) != rope[3].stride(0)):
        raise ValueError("decode_attention(rope=...) takes a dense cache (K and V of one layout), no rows or k_new, "
                         "and unit-stride k / v / cos / sin rows, k and v (cos and sin) at one row stride")
    v_tile = v.shape[-1] if v.dim() == 5 else 1
    if v_tile > 1 and (not is_int8 or block_n % v_tile or v.shape[2] * v_tile < s_max or v.stride(-1) != 1
                       or v.stride(-2) != v_tile or v.stride(2) != hd * v_tile):
        raise ValueError(f"a token-tiled V needs an INT8 cache, block_n a multiple of its tile ({v_tile}), "
                         f"room for {s_max} slots and contiguous tiles; got {tuple(v.shape)}, block_n {block_n}")
    n_splits, split_len = _split_plan(b, kv, s_max, q.device, n_splits, block_n, waves)
    o = torch.empty((b, h, n_splits, hd), dtype=torch.float32, device=q.device)
    m = torch.empty((b, h, n_splits), dtype=torch.float32, device=q.device)  # every split writes its m, l, o
    l_sum = torch.empty((b, h, n_splits), dtype=torch.float32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()  # rows and heads at any stride (int4_gemv_rope's q: y's rows)
    lengths = lengths.to(torch.int32).contiguous()
    has_rows = rows is not None
    rows = rows.to(torch.int32).contiguous() if has_rows else lengths  # a dummy pointer, never read
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2))
    v_strides = (v.stride(0), v.stride(1), v.stride(2))
    out_strides = (o.stride(0), o.stride(1), o.stride(2), m.stride(0), m.stride(1), 1.0 / math.sqrt(hd), split_len)
    if is_int8:
        ng = k_scale.shape[-1]
        block_r = max(16, triton.next_power_of_2(hpk * ng))
        _decode_split_int8_kernel[(b, kv, n_splits)](
            q, k, v, k_scale, v_scale, lengths, rows, o, m, l_sum, *common, *v_strides, k_scale.stride(0), k_scale.stride(1),
            k_scale.stride(2), *out_strides, HPK=hpk, HD=hd, G=hd // ng, NG=ng, BLOCK_R=block_r, BLOCK_HH=block_r // ng,
            BLOCK_N=block_n, DENSE_SCALES=dense_scales, CVT=(2 if q.is_cuda else 1) if cvt is None else cvt,
            V_TILE=v_tile, QK_INT8=qk_int8, HAS_ROWS=has_rows, num_warps=num_warps, num_stages=num_stages)
    else:
        kn, vn, cos, sin = rope if rope is not None else (None,) * 4
        _decode_split_kernel[(b, kv, n_splits)](
            q, k, v, lengths, rows, o, m, l_sum, *common, *out_strides, HPK=hpk, HD=hd, BLOCK_H=BLOCK_H,
            BLOCK_N=block_n, HAS_ROWS=has_rows, num_warps=num_warps, num_stages=num_stages,
            **pdl.launch_args(q, b), kn_ptr=kn, vn_ptr=vn, cos_ptr=cos, sin_ptr=sin,
            sn_b=kn.stride(0) if rope else 0, sc_b=cos.stride(0) if rope else 0, ROPE=rope is not None)
    has_new = k_new is not None
    if not merge:  # the partials, for a consumer that merges them itself (kernels.int4_triton.int4_gemv_merge)
        if has_new:
            raise ValueError("decode_attention(merge=False) takes no k_new / v_new: the merge kernel adds them")
        return o, m, l_sum
    # Merge the splits: out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j (empty splits: m = -inf).
    out = torch.empty((b, h, hd), dtype=out_dtype, device=q.device)
    kn = k_new.contiguous() if has_new else q  # dummy pointers when there is no fresh token (never read)
    vn = v_new.contiguous() if has_new else q
    _merge_kernel[(b * h,)](o, m, l_sum, out, q, kn, vn, n_splits, 1.0 / math.sqrt(hd), q.stride(0), q.stride(1),
                            kn.stride(0), kn.stride(1), H=h, HPK=hpk, HD=hd,
                            BLOCK_S=max(2, triton.next_power_of_2(n_splits)), HAS_NEW=has_new,
                            **pdl.launch_args(q, b))
    return out


@torch.library.custom_op("orin_agent::dense_decode_partials", mutates_args=())
def dense_decode_partials(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`dense_decode_attention` without its merge: the splits' partial outputs o (B, H, S, hd), maxima m and sums l
    (B, H, S), fp32, for a consumer that merges them (kernels.int4_triton.int4_gemv_merge)."""
    return decode_attention(q, k, v, lengths, merge=False)


@dense_decode_partials.register_fake
def _dense_decode_partials_fake(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b, h, hd = q.shape
    s = _split_plan(b, k.shape[1], k.shape[2], q.device)[0]
    return (q.new_empty((b, h, s, hd), dtype=torch.float32), q.new_empty((b, h, s), dtype=torch.float32),
            q.new_empty((b, h, s), dtype=torch.float32))


@torch.library.custom_op("orin_agent::dense_decode_attention_rope", mutates_args=("k", "v"))
def dense_decode_attention_rope(q: Tensor, k_proj: Tensor, v_proj: Tensor, cos: Tensor, sin: Tensor, k: Tensor,
                                v: Tensor, lengths: Tensor) -> Tensor:
    """`dense_decode_attention` with the step's RoPE and cache write in its split kernel (decode_attention's
    `rope`), one launch a layer fewer than kernels.rope_triton.rope_write before it: q (B, H, hd) and k_proj /
    v_proj (B, KV * hd) as the projections give them, cos / sin (B, hd); the token's K and V are written into
    k / v at slot lengths[b] - 1. Returns (B, H, hd) in the caches' dtype."""
    return decode_attention(q, k, v, lengths, out_dtype=k.dtype, rope=(k_proj, v_proj, cos, sin))


@dense_decode_attention_rope.register_fake
def _dense_decode_attention_rope_fake(q: Tensor, k_proj: Tensor, v_proj: Tensor, cos: Tensor, sin: Tensor, k: Tensor,
                                      v: Tensor, lengths: Tensor) -> Tensor:
    return q.new_empty(q.shape, dtype=k.dtype)


@torch.library.custom_op("orin_agent::dense_decode_partials_rope", mutates_args=("k", "v"))
def dense_decode_partials_rope(q: Tensor, k_proj: Tensor, v_proj: Tensor, cos: Tensor, sin: Tensor, k: Tensor,
                               v: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`dense_decode_attention_rope`'s split partials, unmerged (`dense_decode_partials`)."""
    return decode_attention(q, k, v, lengths, merge=False, rope=(k_proj, v_proj, cos, sin))


@dense_decode_partials_rope.register_fake
def _dense_decode_partials_rope_fake(q: Tensor, k_proj: Tensor, v_proj: Tensor, cos: Tensor, sin: Tensor, k: Tensor,
                                     v: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _dense_decode_partials_fake(q, k, v, lengths)


@torch.library.custom_op("orin_agent::dense_decode_attention", mutates_args=())
def dense_decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
    """decode_attention over a dense FP16 / BF16 cache as one opaque op, so that a compiled, CUDA-graphed decode
    step (partition.model's DECODE_PV = "triton") calls it whole: q (B, H, hd) in the cache's dtype, k / v
    (B, KV, S, hd), lengths (B,) int32 -> (B, H, hd) in q's dtype. The sequence is split over enough programs
    to fill the GPU at batch 1 (flash-decoding), where torch.matmul's batched GEMV runs one block per KV head."""
    return decode_attention(q, k, v, lengths, out_dtype=q.dtype)


@dense_decode_attention.register_fake
def _dense_decode_attention_fake(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
    return q.new_empty(q.shape)


@dataclass(frozen=True)
class Int8DecodePast:
    """A layer's past K or V for one decode step over an INT8 cache on the GPU: the whole cache, the
    cache row of each query row, its past length (the slots before the new token) and the longest one.
    `attend` runs the Triton kernels; `dequantize` (partition.model's PastKV protocol) gives the dense
    (B, KV, max_len, hd) past for any other use."""

    cache: Int8KVCache
    rows: Tensor  # (B,) int32
    lengths: Tensor  # (B,) int32
    max_len: int
    qk_int8: bool = False  # decode_attention(qk_int8=...): q quantised, Q.K on the int8 tensor cores

    @property
    def shape(self) -> torch.Size:
        b, kv, _, hd = self.cache.shape
        return torch.Size((self.rows.numel(), kv, self.max_len, hd))

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return self.cache[:, :, :self.max_len].index_select(0, self.rows.long()).dequantize(dtype)

    def attend(self, q: Tensor, k_new: Tensor, v_new: Tensor, past_v: "Int8DecodePast") -> Tensor:
        """q (B, H, hd) and the step's own K/V (B, KV, hd), unquantised -> (B, H, hd) float32."""
        n = max(1, self.max_len)  # no past at all: the kernels see one masked slot
        kc, vc = self.cache, past_v.cache
        vq = vc.q[:, :, :-(-n // vc.token_tile)] if vc.token_tile > 1 else vc.q[:, :, :n]
        return decode_attention(q, kc.q[:, :, :n], vq, self.lengths, kc.scale[:, :, :n],
                                vc.scale[:, :, :n], rows=self.rows, k_new=k_new, v_new=v_new, qk_int8=self.qk_int8)
