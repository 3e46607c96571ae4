"""Triton GPU kernels for the INT8 KV-cache: quantise-on-write, and decode attention (one new token per
row) over the INT8 cache with INT8 reads, FP32 accumulation and an online softmax, split along the
sequence (flash-decoding) so that a batch of 1 still fills the GPU. `kernels.kv_quant` is the plain-
PyTorch reference of both (`quantize`, `attention_reference`); tests/test_kv_triton.py compares them.

Layouts are kernels.kv_quant's: cache int8 (B, KV, S, hd), scales fp16 (B, KV, S, hd / G). The same
attention kernel also reads an FP16 cache (`k_scale=None`), so a benchmark compares INT8 and FP16 with
one code path (scripts/bench_kv.py).

Why Triton rather than CUDA C++ through torch's extension loader: no host compiler or CUDA toolkit at
run time, the kernel is JIT-compiled for the GPU it finds, and it runs on CPU in Triton's interpreter
(TRITON_INTERPRET=1) for tests without a GPU.

Orin (sm_87): the target is not the problem (Triton emits PTX through its own LLVM and assembles it
with the ptxas it bundles, for any Ampere-or-later capability); the toolchain is. JetPack ships no
Triton, NVIDIA's JetPack PyTorch wheels do not pull one in, and PyPI's aarch64 wheels are built for
server (SBSA) CUDA, not L4T: Jetson users build Triton from source (triton-lang/triton#5498; the
JetPack 7.2 image of roboflow/inference#2531 builds it from source for Orin sm_87 and Thor). So: not
verified on a board here; until it is, the CPU/PyTorch path (kernels.kv_quant) is what runs on Orin.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference in kernels.kv_quant is the path
    triton = None
    tl = None

BLOCK_H = 16  # query heads of one KV head, padded to tl.dot's smallest M


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _quantize_write_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, starts_ptr,
                               sx_b, sx_h, sx_t, sq_b, sq_h, sq_s, ss_b, ss_h, ss_s,
                               KV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, N_GROUPS: tl.constexpr):
        pid = tl.program_id(0)  # one (b, kv head, t) per program, all groups of it
        b = pid // (KV * T)
        h = (pid // T) % KV
        t = pid % T
        row = tl.load(rows_ptr + b)
        slot = tl.load(starts_ptr + b) + t
        offs = tl.arange(0, N_GROUPS)[:, None] * G + tl.arange(0, G)[None, :]  # (N_GROUPS, G)
        x = tl.load(x_ptr + b * sx_b + h * sx_h + t * sx_t + offs).to(tl.float32)
        scale = (tl.max(tl.abs(x), axis=1) / 127.0).to(tl.float16)  # (N_GROUPS,), fp16 like the reference
        s32 = scale.to(tl.float32)
        safe = tl.where(s32 > 0, s32, 1.0)
        y = x / safe[:, None]
        q = tl.minimum(tl.maximum(tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5)), -127.0), 127.0)
        tl.store(q_ptr + row * sq_b + h * sq_h + slot * sq_s + offs, q.to(tl.int8))
        tl.store(s_ptr + row * ss_b + h * ss_h + slot * ss_s + tl.arange(0, N_GROUPS), scale)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, o_ptr, m_ptr, l_ptr,
                             sq_b, sq_h, sk_b, sk_h, sk_s, ss_b, ss_h, ss_s, so_b, so_h, so_sp, sm_b, sm_h,
                             sm_scale, split_len,
                             HPK: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, IS_INT8: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(len_ptr + b)
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, length)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HD)
        h_ok = offs_h < HPK
        q = tl.load(q_ptr + b * sq_b + (kvh * HPK + offs_h)[:, None] * sq_h + offs_d[None, :],
                    mask=h_ok[:, None], other=0.0).to(tl.float16)  # (BLOCK_H, HD)
        m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, HD), tl.float32)
        kbase = b * sk_b + kvh * sk_h
        sbase = b * ss_b + kvh * ss_h
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            kv_off = kbase + offs_n[:, None] * sk_s + offs_d[None, :]  # (BLOCK_N, HD)
            k = tl.load(k_ptr + kv_off, mask=n_ok[:, None], other=0)
            v = tl.load(v_ptr + kv_off, mask=n_ok[:, None], other=0)
            if IS_INT8:  # dequantise in registers: one fp16 scale per (slot, group)
                s_off = sbase + offs_n[:, None] * ss_s + (offs_d // G)[None, :]
                k = (k.to(tl.float32) * tl.load(ks_ptr + s_off, mask=n_ok[:, None], other=0.0).to(tl.float32))
                v = (v.to(tl.float32) * tl.load(vs_ptr + s_off, mask=n_ok[:, None], other=0.0).to(tl.float32))
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * sm_scale  # (BLOCK_H, BLOCK_N), fp32 accumulate
            s = tl.where(n_ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            m_i = m_new
        heads = kvh * HPK + offs_h
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + sp * so_sp + offs_d[None, :], acc, mask=h_ok[:, None])
        tl.store(m_ptr + b * sm_b + heads * sm_h + sp, m_i, mask=h_ok)
        tl.store(l_ptr + b * sm_b + heads * sm_h + sp, l_i, mask=h_ok)


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed: `pip install triton` (it ships with CUDA builds of torch)")


def quantize_write(fresh: Tensor, q_cache: Tensor, s_cache: Tensor, rows: Tensor, starts: Tensor) -> None:
    """Quantise new K or V (B, KV, T, hd) and write it into cache rows `rows` (B,) at slots
    starts[b] .. starts[b] + T - 1, in place: q_cache int8 (Bmax, KV, S, hd), s_cache fp16 (Bmax, KV, S, hd / G)."""
    _need_triton()
    b, kv, t, hd = fresh.shape
    n_groups = s_cache.shape[-1]
    fresh = fresh.contiguous()
    if fresh.stride(-1) != 1 or q_cache.stride(-1) != 1 or s_cache.stride(-1) != 1:
        raise ValueError("the last dim (head_dim / groups) must be contiguous")
    _quantize_write_kernel[(b * kv * t,)](
        fresh, q_cache, s_cache, rows.to(torch.int32).contiguous(), starts.to(torch.int32).contiguous(),
        fresh.stride(0), fresh.stride(1), fresh.stride(2), q_cache.stride(0), q_cache.stride(1), q_cache.stride(2),
        s_cache.stride(0), s_cache.stride(1), s_cache.stride(2), KV=kv, T=t, G=hd // n_groups, N_GROUPS=n_groups)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None, n_splits: int | None = None, block_n: int = 64) -> Tensor:
    """q (B, H, hd); k, v (B, KV, S, hd) int8 with scales (B, KV, S, hd / G), or fp16 with no scales;
    lengths (B,) int32: row b attends to slots [0, lengths[b]). Returns (B, H, hd) float32.

    The sequence is cut into `n_splits` pieces (default: enough programs for ~2 waves over the SMs);
    each gives a partial max, sum and output, merged here (flash-decoding's reduction)."""
    _need_triton()
    b, h, hd = q.shape
    kv, s_max = k.shape[1], k.shape[2]
    hpk = h // kv
    if hpk > BLOCK_H or hd & (hd - 1):
        raise ValueError(f"needs <= {BLOCK_H} query heads per KV head and a power-of-two head_dim")
    is_int8 = k_scale is not None
    if n_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        n_splits = max(1, min(math.ceil(2 * sms / (b * kv)), math.ceil(s_max / 256)))
    split_len = math.ceil(s_max / n_splits / block_n) * block_n
    n_splits = math.ceil(s_max / split_len)
    o = torch.empty((b, h, n_splits, hd), dtype=torch.float32, device=q.device)
    m = torch.full((b, h, n_splits), -math.inf, dtype=torch.float32, device=q.device)
    l_sum = torch.zeros((b, h, n_splits), dtype=torch.float32, device=q.device)
    ks = k_scale if is_int8 else k  # dummy pointers when the cache is fp16 (never read)
    vs = v_scale if is_int8 else v
    g = hd // ks.shape[-1] if is_int8 else hd
    q = q.contiguous()
    _decode_split_kernel[(b, kv, n_splits)](
        q, k, v, ks, vs, lengths.to(torch.int32).contiguous(), o, m, l_sum,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), o.stride(0), o.stride(1), o.stride(2), m.stride(0), m.stride(1),
        1.0 / math.sqrt(hd), split_len, HPK=hpk, HD=hd, G=g, BLOCK_H=BLOCK_H, BLOCK_N=block_n, IS_INT8=is_int8)
    # Merge the splits: out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j (empty splits: m = -inf).
    big = m.amax(-1, keepdim=True)  # (B, H, 1)
    w = torch.exp(m - big).nan_to_num(0.0)  # (B, H, splits)
    return (o * w[..., None]).sum(2) / (l_sum * w).sum(-1, keepdim=True)
