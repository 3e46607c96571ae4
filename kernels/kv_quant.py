"""INT8 group-wise KV-cache: quantise on write, dequantise inside attention (plain PyTorch, any device).

Layout: one layer's K (or V) cache is an int8 tensor (B, KV, S, hd) plus FP16 scales (B, KV, S, hd / G),
one scale per token, per KV head, per group of G consecutive channels of head_dim (G = 32 or 64).
Symmetric absmax quantisation, q = round(x / s) clamped to [-127, 127], s = absmax / 127 rounded to
FP16 *before* dividing, so a value dequantises with exactly the scale that is stored. No zero-points:
post-RoPE K and V are close to zero-centred per group, and a zero-point would add 2 more bytes per
group for little (KIVI, arXiv 2402.02750, uses them for 2-bit, not 8-bit).

Bytes per token per KV head: hd + 2 * hd / G, against 2 * hd for FP16 (hd = 64: -46.9 % at G = 32,
-48.4 % at G = 64; -50 % before scales).

`Int8KVCache` is a drop-in for a runner's preallocated cache buffer: `cache[row, :, a:b] = fresh`
quantises the new K/V on write (so `partition.runners.base.write_new_kv` works unchanged), and
`cache[rows, :, :L]` is a `QuantizedPast` view that the attention in `partition.model` dequantises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

GROUP_SIZES = (32, 64)
QMAX = 127  # symmetric: -128 is never produced, so negation cannot overflow
Index = Union[int, slice, Tensor, tuple]


def check_group(head_dim: int, group: int) -> None:
    if group not in GROUP_SIZES:
        raise ValueError(f"KV quantisation group must be one of {GROUP_SIZES}, got {group}")
    if head_dim % group:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the quantisation group {group}")


def quantize(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x (..., hd) float -> (int8 (..., hd), fp16 scales (..., hd / group))."""
    hd = x.shape[-1]
    check_group(hd, group)
    g = x.float().unflatten(-1, (hd // group, group))  # (..., n_groups, G)
    scale = (g.abs().amax(-1) / QMAX).to(torch.float16)  # (..., n_groups)
    s32 = scale.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))  # an all-zero group (or fp16 underflow) -> q = 0
    q = torch.round(g / safe[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q.flatten(-2), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 (..., hd) and fp16 scales (..., hd / G) -> (..., hd) in `dtype` (math in fp32)."""
    n_groups = scale.shape[-1]
    g = q.float().unflatten(-1, (n_groups, q.shape[-1] // n_groups)) * scale.float()[..., None]
    return g.flatten(-2).to(dtype)


def fake_quantize(x: Tensor, group: int) -> Tensor:
    """x through the INT8 round trip, in x's dtype: what attention sees of a cached K or V."""
    return dequantize(*quantize(x, group), x.dtype)


@dataclass(frozen=True)
class QuantizedPast:
    """A view of past K or V, (B, KV, P, hd) int8 plus scales: what a slice receives as `past`."""

    q: Tensor  # (B, KV, P, hd) int8
    scale: Tensor  # (B, KV, P, hd / G) fp16

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return dequantize(self.q, self.scale, dtype)

    def __getitem__(self, key: Index) -> "QuantizedPast":
        return QuantizedPast(self.q[key], self.scale[key])

    def index_select(self, dim: int, index: Tensor) -> "QuantizedPast":
        if dim % 4 == 3:
            raise ValueError("a quantised cache cannot be indexed along head_dim (the groups would split)")
        return QuantizedPast(self.q.index_select(dim, index), self.scale.index_select(dim, index))


def tile_tokens(x: Tensor, tile: int) -> Tensor:
    """(..., S, hd) -> (..., S / tile, hd, tile), contiguous: `tile` consecutive slots of a channel become
    adjacent (Int8KVCache(token_tile=tile)'s storage). S must be a multiple of `tile`."""
    *lead, s, hd = x.shape
    return x.reshape(*lead, s // tile, tile, hd).transpose(-1, -2).contiguous()


def untile_tokens(t: Tensor) -> Tensor:
    """The inverse of `tile_tokens`: (..., S / tile, hd, tile) -> (..., S, hd) (a copy)."""
    *lead, n, hd, tile = t.shape
    return t.transpose(-1, -2).reshape(*lead, n * tile, hd)


class Int8KVCache:
    """One layer's K or V cache, preallocated: int8 (B, KV, S, hd) and fp16 scales (B, KV, S, hd / G).

    Indexing follows a dense (B, KV, S, hd) tensor's for the first three dims; head_dim is never
    indexed (it is cut into groups).

    token_tile T > 1 stores the int8 values token-tiled, (B, KV, S / T, hd, T): T consecutive slots of a
    channel are adjacent bytes. That is the V layout the Triton decode kernel reads fast (V is reduced
    over slots; kernels.kv_triton); the bytes and the scales are the same. Reads through indexing
    untile the slots they need (a copy, for prefill chunks); a write through `__setitem__` re-tiles the
    whole cache (correct, slow: the Triton write path kernels.kv_triton.quantize_write writes tiled)."""

    def __init__(self, shape: tuple[int, int, int, int], group: int, device: torch.device | str = "cpu",
                 token_tile: int = 1) -> None:
        b, kv, s, hd = shape
        check_group(hd, group)
        if token_tile < 1 or s % token_tile:
            raise ValueError(f"token_tile must divide the cache length {s}, got {token_tile}")
        self.group = group
        self.token_tile = token_tile
        self.q = torch.zeros(shape if token_tile == 1 else (b, kv, s // token_tile, hd, token_tile),
                             dtype=torch.int8, device=device)
        self.scale = torch.zeros((b, kv, s, hd // group), dtype=torch.float16, device=device)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scale.shape[:3], self.q.shape[3]))

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def values(self, slots: int | None = None) -> Tensor:
        """The int8 values as (B, KV, S', hd), S' >= the first `slots` slots (all by default): the tensor
        itself when untiled, else an untiled copy of the tiles that hold them."""
        if self.token_tile == 1:
            return self.q
        n = self.q.shape[2] if slots is None else -(-slots // self.token_tile)
        return untile_tokens(self.q[:, :, :n])

    def __getitem__(self, key: Index) -> QuantizedPast:
        if self.token_tile == 1:
            return QuantizedPast(self.q[key], self.scale[key])
        upto = None  # the common read, cache[rows, :, :n]: untile only the first n slots
        if isinstance(key, tuple) and len(key) >= 3 and isinstance(key[2], slice) and key[2].stop is not None \
                and key[2].stop >= 0 and key[2].step in (None, 1):
            upto = key[2].stop
        return QuantizedPast(self.values(upto)[key], self.scale[key])

    def write_rows(self, fresh: Tensor, rows: Tensor, starts: Tensor) -> None:
        """Quantise new K or V (B, KV, T, hd) into cache row rows[b] at slots starts[b] .. + T - 1, row by
        row through `__setitem__` (the one-launch CUDA write is kernels.kv_triton.quantize_write, equal to
        this bit for bit; the kernel module builds on this one, never the reverse)."""
        t = fresh.shape[2]
        for i, (row, start) in enumerate(zip(rows.tolist(), starts.tolist())):
            self[row, :, start:start + t] = fresh[i]

    def __setitem__(self, key: Index, value: Tensor) -> None:
        """Quantise on write: `value` is float K or V with the indexed shape (..., hd)."""
        q, scale = quantize(value, self.group)
        if self.token_tile == 1:
            self.q[key] = q
        else:
            dense = self.values()
            dense[key] = q
            self.q.copy_(tile_tokens(dense, self.token_tile))
        self.scale[key] = scale


def fp_cache_bytes(shape: tuple[int, int, int, int], bytes_per_value: int = 2) -> int:
    """Bytes of an unquantised cache buffer of `shape` (FP16 by default)."""
    b, kv, s, hd = shape
    return b * kv * s * hd * bytes_per_value


def int8_cache_bytes(shape: tuple[int, int, int, int], group: int) -> int:
    """Bytes of an `Int8KVCache` of `shape`: int8 values plus one fp16 scale per group."""
    b, kv, s, hd = shape
    return b * kv * s * (hd + 2 * (hd // group))


def attention_reference(q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor,
                        lengths: Tensor) -> Tensor:
    """Decode attention over an INT8 cache, the reference the GPU kernel is tested against.

    q (B, H, hd) float (one new token per row, RoPE applied); k_q/v_q (B, KV, S, hd) int8 and scales
    (B, KV, S, hd / G) fp16; lengths (B,) int: row b attends to slots [0, lengths[b]) (the new token's
    own K/V already written there). Grouped-query: head h reads KV head h // (H / KV).
    Returns (B, H, hd) float32."""
    b, h, hd = q.shape
    kv = k_q.shape[1]
    keys = dequantize(k_q, k_scale, torch.float32).repeat_interleave(h // kv, dim=1)  # (B, H, S, hd)
    values = dequantize(v_q, v_scale, torch.float32).repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) / hd ** 0.5  # (B, H, S)
    slots = torch.arange(k_q.shape[2], device=q.device)
    scores = scores.masked_fill(slots[None, None, :] >= lengths.to(q.device)[:, None, None], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), values)
