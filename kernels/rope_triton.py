"""One Triton kernel for the part of a decode step's attention between the q/k/v projections and the
attention itself: RoPE on q and k, and the new K/V written into the dense cache at the token's slot.

In the compiled, CUDA-graphed Llama-3-8B INT4 decode step on an H200 that part was ~0.5 ms of 2.9 ms of
kernels a step: five inductor kernels a layer (the q/k rotations fused with the projection's split, the
scatters into the cache, and the copies back into the cache's views, docs/BENCHMARKS.md), each a few
microseconds of launch and one DRAM round trip for ~30 KB of data. `rope_write` is one launch a layer:
a program per head, q heads rotated into the output, KV heads rotated (K) or copied (V) into the caches.

Numbers: the same as partition.model's `q * cos + rotate_half(q) * sin` with cos / sin at the model's dtype
(rope_cos_sin), computed in fp32 and rounded once to the cache's dtype (inductor's fused kernel does the
same; eager torch rounds after each op). Batch of decode rows: each row its own slot.

The same kernel serves an eager prefill chunk (T tokens a row, each at its own slot; q comes back in attention's
(B, H, T, hd) layout), where the torch formulation is twelve launches a layer (four elementwise kernels and a
cat for each of q and k, two scatters) in a chunk that is launch-bound on the GPU (partition.model ROPE_FUSED).

`rope_write` is a torch custom op that mutates the two caches (declared, so torch.compile orders it and
reinplaces it); partition.model.Attention uses it on CUDA for a decode step and a prefill chunk in in-place
cache mode where Triton is installed and partition.model.DECODE_PV is "triton".
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: partition.model keeps its torch formulation
    triton = None
    tl = None

from kernels import pdl


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def cos_sin(cos_ptr, sin_ptr, off, HD: tl.constexpr):
        """A token's cos / sin rows at `off`, each as its two halves in fp32: (c1, c2, s1, s2)."""
        half = tl.arange(0, HD // 2)
        c1 = tl.load(cos_ptr + off + half).to(tl.float32)  # cos = cat(f, f): its two halves are equal
        c2 = tl.load(cos_ptr + off + HD // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + off + half).to(tl.float32)
        s2 = tl.load(sin_ptr + off + HD // 2 + half).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def rotate(x1, x2, c1, c2, s1, s2):
        """A head's halves x1, x2 (fp32) rotated, x * cos + rotate_half(x) * sin: (x1 c1 - x2 s1, x2 c2 + x1 s2).
        One formula for this module's kernel and kernels.int4_triton's q/k/v epilogue, so both give the same bits."""
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, qo_ptr, T,
                           sq_b, sq_t, sk_b, sk_t, sv_b, sv_t, sc_b, sc_t, sp_b, sp_t, skc_b, skc_h, skc_s,
                           svc_b, svc_h, svc_s, H: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr = False):
        """Program (b * T + t, head): head < H rotates token t's q head into qo (B, H, T, HD); H <= head < H + KV
        rotates its k head (head - H) into kc[b, head - H, pos[b, t]] and copies its v head into vc at the
        same slot. PDL: kernels.pdl."""
        pdl.start(PDL)
        bt = tl.program_id(0)
        b = bt // T
        t = bt % T
        hh = tl.program_id(1)
        half = tl.arange(0, HD // 2)
        c1, c2, s1, s2 = cos_sin(cos_ptr, sin_ptr, b * sc_b + t * sc_t, HD)
        if hh < H:
            src = q_ptr + b * sq_b + t * sq_t + hh * HD
            r1, r2 = rotate(tl.load(src + half).to(tl.float32), tl.load(src + HD // 2 + half).to(tl.float32),
                            c1, c2, s1, s2)
            dst = qo_ptr + ((b * H + hh) * T + t) * HD
            tl.store(dst + half, r1.to(qo_ptr.dtype.element_ty))
            tl.store(dst + HD // 2 + half, r2.to(qo_ptr.dtype.element_ty))
        else:
            kh = hh - H
            slot = tl.load(pos_ptr + b * sp_b + t * sp_t).to(tl.int64)
            src = k_ptr + b * sk_b + t * sk_t + kh * HD
            r1, r2 = rotate(tl.load(src + half).to(tl.float32), tl.load(src + HD // 2 + half).to(tl.float32),
                            c1, c2, s1, s2)
            dst = kc_ptr + b * skc_b + kh * skc_h + slot * skc_s
            tl.store(dst + half, r1.to(kc_ptr.dtype.element_ty))
            tl.store(dst + HD // 2 + half, r2.to(kc_ptr.dtype.element_ty))
            full = tl.arange(0, HD)
            vals = tl.load(v_ptr + b * sv_b + t * sv_t + kh * HD + full)
            tl.store(vc_ptr + b * svc_b + kh * svc_h + slot * svc_s + full, vals.to(vc_ptr.dtype.element_ty))


@torch.library.custom_op("orin_agent::rope_write", mutates_args=("k_cache", "v_cache"))
def rope_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
    """A decode step: q (B, H * hd), k / v (B, KV * hd) (one token a row, any row stride), cos / sin (B, hd) at
    the model's dtype, positions (B,) int -> q rotated, (B, H, hd). A prefill chunk: q (B, T, H * hd), k / v
    (B, T, KV * hd), cos / sin (B, T, hd), positions (B, T) -> q rotated, (B, H, T, hd) (attention's layout).
    Either way k is rotated and v copied into k_cache / v_cache (B, KV, L, hd) at slot positions[b(, t)] (unit
    stride along hd, unit stride along the hidden size of q / k / v / cos / sin); q comes back in the cache's
    dtype."""
    step = q.dim() == 2
    if step:
        q, k, v, cos, sin, positions = (x.unsqueeze(1) for x in (q, k, v, cos, sin, positions))
    b, t, hq = q.shape
    kv, hd = k_cache.shape[1], k_cache.shape[3]
    h = hq // hd
    if hd & (hd - 1) or k.shape[2] != kv * hd or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"rope_write takes a power-of-two head_dim and unit-stride caches, got hd={hd}, "
                         f"k {tuple(k.shape)}, caches of strides {k_cache.stride()} / {v_cache.stride()}")
    out = torch.empty((b, h, hd) if step else (b, h, t, hd), device=q.device, dtype=k_cache.dtype)  # same layout
    _rope_write_kernel[(b * t, h + kv)](q, k, v, cos, sin, positions, k_cache, v_cache, out, t,
                                        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                        cos.stride(0), cos.stride(1), positions.stride(0), positions.stride(1),
                                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                        H=h, HD=hd, num_warps=1, **pdl.launch_args(q, b * t))
    return out


@rope_write.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
      v_cache: Tensor) -> Tensor:
    hd = k_cache.shape[3]
    if q.dim() == 2:
        return q.new_empty((q.shape[0], q.shape[1] // hd, hd), dtype=k_cache.dtype)
    return q.new_empty((q.shape[0], q.shape[2] // hd, q.shape[1], hd), dtype=k_cache.dtype)
