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

`rope_write` is a torch custom op that mutates the two caches (declared, so torch.compile orders it and
reinplaces it); partition.model.Attention uses it on CUDA for a decode step (T = 1) in in-place cache mode
where Triton is installed and partition.model.DECODE_PV is "triton".
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


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, qo_ptr,
                           sq_b, sk_b, sv_b, sc_b, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
                           H: tl.constexpr, HD: tl.constexpr):
        """Program (b, head): head < H rotates q's head into qo (B, H, HD); H <= head < H + KV rotates k's
        head (head - H) into kc[b, head - H, pos[b]] and copies v's into vc at the same slot."""
        b = tl.program_id(0)
        hh = tl.program_id(1)
        half = tl.arange(0, HD // 2)
        c1 = tl.load(cos_ptr + b * sc_b + half).to(tl.float32)  # cos = cat(f, f): its two halves are equal
        c2 = tl.load(cos_ptr + b * sc_b + HD // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + b * sc_b + half).to(tl.float32)
        s2 = tl.load(sin_ptr + b * sc_b + HD // 2 + half).to(tl.float32)
        if hh < H:
            src = q_ptr + b * sq_b + hh * HD
            x1 = tl.load(src + half).to(tl.float32)
            x2 = tl.load(src + HD // 2 + half).to(tl.float32)
            dst = qo_ptr + (b * H + hh) * HD
            tl.store(dst + half, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty))
            tl.store(dst + HD // 2 + half, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty))
        else:
            kh = hh - H
            slot = tl.load(pos_ptr + b).to(tl.int64)
            src = k_ptr + b * sk_b + kh * HD
            x1 = tl.load(src + half).to(tl.float32)
            x2 = tl.load(src + HD // 2 + half).to(tl.float32)
            dst = kc_ptr + b * skc_b + kh * skc_h + slot * skc_s
            tl.store(dst + half, (x1 * c1 - x2 * s1).to(kc_ptr.dtype.element_ty))
            tl.store(dst + HD // 2 + half, (x2 * c2 + x1 * s2).to(kc_ptr.dtype.element_ty))
            full = tl.arange(0, HD)
            vals = tl.load(v_ptr + b * sv_b + kh * HD + full)
            tl.store(vc_ptr + b * svc_b + kh * svc_h + slot * svc_s + full, vals.to(vc_ptr.dtype.element_ty))


@torch.library.custom_op("orin_agent::rope_write", mutates_args=("k_cache", "v_cache"))
def rope_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
    """q (B, H * hd), k / v (B, KV * hd) (rows of one decode token each, any row stride), cos / sin (B, hd)
    at the model's dtype, positions (B,) int: k rotated and v written into k_cache / v_cache (B, KV, L, hd)
    at slot positions[b] (unit stride along hd); returns q rotated, (B, H, hd) in the cache's dtype."""
    b, hq = q.shape
    kv, hd = k_cache.shape[1], k_cache.shape[3]
    h = hq // hd
    if hd & (hd - 1) or k.shape[1] != kv * hd or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"rope_write takes a power-of-two head_dim and unit-stride caches, got hd={hd}, "
                         f"k {tuple(k.shape)}, caches of strides {k_cache.stride()} / {v_cache.stride()}")
    out = torch.empty((b, h, hd), device=q.device, dtype=k_cache.dtype)
    _rope_write_kernel[(b, h + kv)](q, k, v, cos, sin, positions, k_cache, v_cache, out,
                                    q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
                                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                    v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                    H=h, HD=hd, num_warps=1)
    return out


@rope_write.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
      v_cache: Tensor) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] // k_cache.shape[3], k_cache.shape[3]), dtype=k_cache.dtype)
