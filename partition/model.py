"""The one model definition: a Llama-family decoder (RMSNorm, RoPE with Llama-3 scaling, grouped-query
attention, SwiGLU, optional QKV bias, tied or untied embeddings), and `SliceModule`, a contiguous
layer range [a, b) that is the unit of export, engine build and execution.

Module names follow Hugging Face's (`model.layers.N.self_attn.q_proj`, ...) so a checkpoint's state
dict loads with no renaming. The attention is written so that the same code exports to an ONNX graph
TensorRT 8.5 and 10.x parse: MatMul + Softmax (no fused Attention op), masks built from int32
positions with a finite negative value (never -inf: it turns into NaN in fp16), no Python branch on a
tensor's value (those become `If` nodes), RMSNorm and softmax in fp32.

KV-cache contract of a slice: it receives each layer's past K and V, shape (B, n_kv_heads, P, head_dim),
and returns only the new K and V, shape (B, n_kv_heads, T, head_dim); the runner writes those into its
own preallocated cache by position. Past slot k of row b is attended iff k < positions[b, 0], so a
runner may pass either exactly the filled prefix (P = start) or its whole fixed-size buffer.

In-place cache mode (`cache_in_place=True`, the runtime path of the PyTorch runner on CUDA, never used
for export): the past tensors are views of the runner's cache covering slots [0, L) with L > every new
position; each layer writes its new K/V into them by position (`scatter_`) and attends over the view
at the model dtype (SDPA for prefill, two batched GEMMs for a decode step), so no step concatenates,
copies or casts the cache. Slot k is attended by query i iff k <= positions[b, i]. The new K/V are still returned,
except by a decode step or prefill chunk through the Triton RoPE kernel (ROPE_FUSED), which returns the cache views
themselves (every caller of this mode drops them: the cache already holds them).
A past may also be a quantised view (`PastKV`, e.g. kernels.kv_quant.QuantizedPast): the export
formulation dequantises it; in-place cache mode takes dense caches only. A `DecodePast` (INT8 cache on
CUDA) runs a decode step's attention over itself plus the fresh K/V in GPU kernels instead.
"""
from __future__ import annotations

import importlib.util
import math
from typing import Protocol, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from partition.config import ModelConfig

INT4_GEMV_MAX_M = 4  # kernels.int4_triton.GEMV_MAX_M (not imported here: it imports Triton); tests/test_int4_triton.py ties them

# Finite "minus infinity" for masks: the most negative fp16 value, so the mask survives a cast to fp16
# and exp() of it underflows to exactly 0 in fp32 softmax.
MASK_VALUE = -65504.0
# SDPA backends of the in-place path. cuDNN is left out: it builds a new plan for every key length, so
# an eager decode step (length + 1 each step) cost 92 ms instead of ~20 on an H200 (docs/BENCHMARKS.md).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class PastKV(Protocol):
    """A past K or V kept in another form than a dense tensor (an INT8 cache view): it has the dense
    shape (B, KV, P, hd) and turns itself into that tensor inside attention."""

    @property
    def shape(self) -> torch.Size: ...

    def dequantize(self, dtype: torch.dtype) -> Tensor: ...


class DecodePast(PastKV, Protocol):
    """A past that attends a decode step itself (kernels.kv_triton.Int8DecodePast: Triton kernels over
    an INT8 cache): q (B, H, hd) and the step's own unquantised K/V (B, KV, hd) -> (B, H, hd) float32.
    Runtime only; the export formulation never sees one."""

    def attend(self, q: Tensor, k_new: Tensor, v_new: Tensor, past_v: "DecodePast") -> Tensor: ...


Past = Union[Tensor, PastKV]


def dense_past(past: Past, dtype: torch.dtype) -> Tensor:
    return past if isinstance(past, Tensor) else past.dequantize(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _fused(self, x: Tensor, residual: Tensor | None = None) -> bool:
        """Whether the norm of x (+ residual) runs as one kernel (kernels.norm_triton, FUSED_ELEMENTWISE)."""
        return _fused_elementwise(x, self.weight) and (
            residual is None or (residual.stride(-1) == 1 and residual.dtype == x.dtype))

    def forward(self, x: Tensor) -> Tensor:
        if self._fused(x):
            from kernels.norm_triton import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()  # normalise in fp32 whatever the model dtype (fp16 overflows in x**2)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def norm(self, x: Tensor, pending: Tensor | None, act8: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """(self(x + pending), x + pending, the first one's ACT8_FORMAT codes or None), pending None for no add.
        act8: the consumer takes int8 activations (QuantLinear.takes_act8); where the fused kernels apply the
        codes come from the norm's own kernel (kernels.norm_triton's `_a8` ops), else None."""
        if act8 and (self._fused(x) if pending is None else self._fused(pending, x)):
            from kernels import norm_triton

            if pending is None:
                y, q = norm_triton.rms_norm_a8(x, self.weight, self.eps)
                return y, x, q
            return norm_triton.add_rms_norm_a8(pending, x, self.weight, self.eps)
        if pending is None:
            return self(x), x, None
        y, h = self.add_forward(pending, x)
        return y, h, None

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(self(x + residual), x + residual): the residual add and the norm that reads it, in one kernel on CUDA."""
        if self._fused(x, residual):
            from kernels.norm_triton import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        h = x + residual
        return self(h), h


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim / 2,), with the Llama-3 low/high-frequency rescaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1+ scaling (Meta's reference `apply_scaling`): long wavelengths are slowed by `factor`,
    # short ones kept, and the band in between interpolated smoothly.
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin, shape (B, 1, T, head_dim), computed in fp32 from int32 positions (B, T)."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_mask(positions: Tensor, past_len: int | Tensor) -> Tensor:
    """Additive fp32 mask (B, 1, T, P + T): past slot k visible iff k < positions[:, 0]; new key j
    visible to query i iff position_j <= position_i."""
    start = positions[:, :1]  # (B, 1)
    slots = torch.arange(past_len, dtype=positions.dtype, device=positions.device)  # (P,)
    past_ok = slots[None, None, :] < start[:, :, None]  # (B, 1, P)
    past_ok = past_ok.expand(-1, positions.shape[1], -1)  # (B, T, P)
    new_ok = positions[:, None, :] <= positions[:, :, None]  # (B, T, T)
    ok = torch.cat((past_ok, new_ok), dim=-1)  # (B, T, P + T)
    zero = torch.zeros((), dtype=torch.float32, device=positions.device)
    neg = torch.full((), MASK_VALUE, dtype=torch.float32, device=positions.device)
    return torch.where(ok, zero, neg)[:, None]  # (B, 1, T, P + T)


def cache_mask(positions: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """Additive mask (B, 1, T, L) at the model dtype for in-place cache mode: slot k visible to query i
    iff k <= positions[b, i] (its own new K/V are already written at slot positions[b, i])."""
    slots = torch.arange(length, dtype=positions.dtype, device=positions.device)  # (L,)
    ok = slots[None, None, :] <= positions[:, :, None]  # (B, T, L)
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    neg = torch.full((), MASK_VALUE, dtype=dtype, device=positions.device)
    return torch.where(ok, zero, neg)[:, None]


# How the dense in-place decode step attends, (B, KV, G, hd) queries over a (B, KV, L, hd) cache: "matmul"
# (torch.matmul: cuBLAS picks a batched small-N GEMV for probs @ V, 22.5 us a layer for Llama-3-8B at L = 641 in
# the compiled step on an H200 while the weights stream through L2, 6.9 us for the whole attention with the
# cache L2-resident), "transposed" (probs @ V as (V^T P^T)^T), "reduce" (a broadcast multiply and a sum over L,
# one inductor reduction kernel), or "triton" (kernels.kv_triton.dense_decode_attention: the sequence split over
# enough programs to fill the GPU, flash-decoding; CUDA only, "matmul" elsewhere). The default is "triton" where
# Triton is installed: the compiled, graphed Llama-3-8B INT4 step went from 4.22 to 3.82 ms with it on an H200,
# although alone, with its cache read from HBM, it is the slower (11.3 against 7.7 us a layer): in the step, the
# cuBLAS GEMV behind probs @ V took 22.5 us a layer (scripts/bench_cuda_decode.py --profile / --attention-sweep,
# docs/BENCHMARKS.md).
DECODE_PV = "triton" if importlib.util.find_spec("triton") is not None else "matmul"
DECODE_PV_CHOICES = ("matmul", "transposed", "reduce", "triton")
# With DECODE_PV "triton", a decode step's RoPE and cache write run as one kernel a layer
# (kernels.rope_triton.rope_write) instead of inductor's five (rotations, scatters, copies back into the cache's
# views: ~0.5 ms of a 2.9 ms Llama-3-8B INT4 step's kernels on an H200, docs/BENCHMARKS.md), and so do an eager
# prefill chunk's, instead of twelve launches a layer (four elementwise kernels and a cat for each of q and k, two
# scatters: 12 of the ~28 launches a layer of the Llama-3-8B prefill profiled on an H200, whose 512-token chunk
# is launch-bound, ~19 ms of kernels in a 34-60 ms wall; docs/BENCHMARKS.md).
ROPE_FUSED = True
# On CUDA with Triton installed, RMSNorm (with the residual add before it: DecoderLayer.run_pending) and SiLU(gate) * up
# of a fused gate/up projection run as one kernel each (kernels.norm_triton) instead of eager PyTorch's ~8 and 2:
# a graphed batch-1 decode step of a small model is bound by its kernel count (SmolLM2-135M on an H200: ~27 kernels
# a layer, ~3 us each, docs/BENCHMARKS.md "SmolLM2 on the GPU").
FUSED_ELEMENTWISE = True
# A decode step over CUDA INT4 layers on the Triton GEMV (fused q/k/v and gate/up) runs the work of the small kernels
# between the GEMVs in the GEMVs' own epilogues (kernels.int4_triton.int4_gemv_epilogue, DecoderLayer.run_epilogues):
# the residual adds, both RMSNorms and SiLU * up, 7 kernels a Llama layer instead of 10. On an H100
# (docs/BENCHMARKS.md, twentieth session): Llama-3-8B INT4 decode +0.2-1.7 %, SmolLM2-135M's shape +6.7-7.5 %. With
# quantised activations (ACT "int8" / "int16") the epilogues also write the next GEMV's codes
# (int4_gemv_epilogue_a8), and ACT8_FUSED below is left to the step without them.
GEMV_EPILOGUES = True
# Where a decode step's INT4 GEMVs take int8 activations (kernels.int4_triton ACT "int8"), the RMSNorms and SiLU * up
# before them write the codes too (kernels.norm_triton's `_a8` ops) instead of a quantise launch per GEMV (129 in
# a Llama-3-8B step, ~1.4 us each on an H200, docs/BENCHMARKS.md). Off: each GEMV quantises its own input. (Where
# the GEMV epilogues run, they make the codes: GEMV_EPILOGUES.)
ACT8_FUSED = True
# Where the GEMV epilogues run (GEMV_EPILOGUES) and RoPE + the cache write would be kernels.rope_triton's kernel
# (ROPE_FUSED), the fused q/k/v GEMV does them in its own epilogue instead (kernels.int4_triton.int4_gemv_rope): a
# Llama layer's decode step is 6 kernels, not 7. Off: the Llama-3-8B INT4 step measured even with it (386.2 against
# 388.3 tok/s, H100, docs/BENCHMARKS.md twenty-fourth session); the small models' step, bound by its kernel count,
# not timed yet (bench_cuda_decode.py's "-ropeepi" variants). The values are the same either way
# (tests/test_norm_triton.py).
ROPE_EPILOGUE = False
# The decode step's prologue, lean: where every layer attends through the Triton decode kernel (which reads the
# visible lengths) no additive mask is built (six kernels a step), and where the first q/k/v GEMV takes codes they
# come from one act8_quant launch over the embedding times the first norm's weight (four kernels fewer). The same
# values either way (tests); ten of a Llama-3-8B step's ~22 small kernels (H100 profile, docs/BENCHMARKS.md
# twenty-fifth session). Not timed on a GPU yet: off is bench_cuda_decode.py's "-prologue0" variants, for the A/B.
LEAN_PROLOGUE = True
# Where the GEMV epilogues run and a decode step attends through the Triton decode kernel over a dense cache, o_proj's
# GEMV merges the attention's split partials itself (kernels.int4_triton.int4_gemv_merge: each program its own
# columns, before its loop) instead of kernels.kv_triton's merge kernel a launch earlier: a Llama layer's step is 6
# kernels, not 7. The merge kernel took 54 us of a 2.6 ms Llama-3-8B INT4 step, 1.7 us a layer plus its launch gap
# (H100 profile, docs/BENCHMARKS.md twenty-fifth session). Opt-in and untimed: no GPU has run it (bench_cuda_decode.py's
# "-mergeo" variants). The same formula as the merge kernel, so the same values to fp32's summation order (tests).
MERGE_IN_O = False
# Where a decode step's RoPE and cache write would be kernels.rope_triton's kernel (ROPE_FUSED, the Triton decode
# attention over a dense cache), the attention's split kernel does them itself (kernels.kv_triton
# dense_decode_attention_rope: each program rotates its query heads; the program whose split holds the token's slot
# writes its K and V there first): one launch a layer fewer. rope_write took 51 us of a 2.6 ms Llama-3-8B INT4 step,
# 1.6 us a layer plus its launch gap (H100 profile, docs/BENCHMARKS.md twenty-fifth session). Unlike the RoPE epilogue
# (ROPE_EPILOGUE, measured even), the work lands at the start of the attention's programs, and the write on the
# split with the fewest slots, not at the end of the q/k/v GEMV's last program. Opt-in and untimed: no GPU has run
# it (bench_cuda_decode.py's "-ropeattn" variants). The same values, bit for bit (tests).
ROPE_IN_ATTENTION = False


def _takes_act8(linears: list[nn.Module], x: Tensor) -> bool:
    """Whether every one of linears takes x's rows as ACT8_FORMAT codes (QuantLinear.takes_act8; x: their input,
    or anything with its rows)."""
    return ACT8_FUSED and all(hasattr(lin, "takes_act8") and lin.takes_act8(x) for lin in linears)


def _proj(lin: nn.Module, x: Tensor, x8: Tensor | None) -> Tensor:
    """lin(x), given x's ACT8_FORMAT codes where the caller made them (`_takes_act8`)."""
    return lin(x) if x8 is None else lin(x, x8)


def _fused_elementwise(x: Tensor, weight: Tensor | None = None) -> bool:
    if not FUSED_ELEMENTWISE:
        return False
    from kernels import norm_triton

    return norm_triton.applies(x, weight)


def _int4_prefetch(layers: nn.ModuleList, h: Tensor):
    """A prefill chunk over CUDA INT4 layers (kernels.int4_triton): kernels.weight_only.LayerPrefetch, which
    dequantises layer i + 1's weights on a side stream while layer i runs; None anywhere else (the decode step,
    compiled, never gets here with more than INT4_GEMV_MAX_M rows)."""
    if not layers or h.shape[0] * h.shape[1] <= INT4_GEMV_MAX_M or getattr(
            layers[0].mlp.down_proj, "kernel", None) != "int4_triton":
        return None
    from kernels.weight_only import LayerPrefetch

    return LayerPrefetch.of([layer.projections() for layer in layers], h.shape[0] * h.shape[1], h.dtype, h.device)


def _gemv_epilogues(layers: nn.ModuleList, h: Tensor) -> bool:
    """Whether every layer's decode step can run DecoderLayer.run_epilogues on h (GEMV_EPILOGUES): q/k/v and gate/up
    fused (fuse_quantized_projections), and each of the four weights an INT4 QuantLinear whose GEMV takes h's rows
    with an epilogue (QuantLinear.takes_epilogue; gate/up's halves on tile edges)."""
    if not GEMV_EPILOGUES or not layers:
        return False
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        lins = [getattr(a, "qkv_proj", None), a.o_proj, m.down_proj]
        gate_up = getattr(m, "gate_up_proj", None)
        if not (all(hasattr(lin, "takes_epilogue") and lin.takes_epilogue(h) for lin in lins)
                and hasattr(gate_up, "takes_epilogue") and gate_up.takes_epilogue(h, silu=True)):
            return False
    return True


def _triton_decode_shapes(q: Tensor, hd: int, grp: int, pv: str | None = None) -> bool:
    """Where the Triton decode kernels apply: pv (default DECODE_PV) "triton", CUDA, a power-of-two head_dim, at
    most 16 query heads per KV head (kv_triton.BLOCK_H)."""
    return (DECODE_PV if pv is None else pv) == "triton" and q.is_cuda and hd & (hd - 1) == 0 and grp <= 16


def decode_attention_dense(q: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor, pv: str | None = None,
                           lengths: Tensor | None = None) -> Tensor:
    """One decode step's attention over a dense cache: q (B, KV, G, hd) (each KV head's G query heads as rows),
    past_k / past_v (B, KV, L, hd), mask (B, 1, 1, L) additive; scores and softmax in fp32, the products at the
    cache's dtype. Returns (B, KV, G, hd). lengths: (B,) int32 visible slots per row where the caller knows them
    (the Triton kernel's input; otherwise counted from the mask)."""
    pv = DECODE_PV if pv is None else pv
    b, kv, grp, hd = q.shape
    if _triton_decode_shapes(q, hd, grp, pv):
        from kernels.kv_triton import dense_decode_attention

        if lengths is None:
            lengths = (mask[:, 0, 0] == 0).sum(-1).to(torch.int32)  # a prefix of slots per row, as cache_mask makes
        return dense_decode_attention(q.reshape(b, kv * grp, hd), past_k, past_v, lengths).reshape(q.shape)
    scores = torch.matmul(q, past_k.transpose(2, 3)).float() / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores + mask, dim=-1).to(past_v.dtype)  # (B, KV, G, L)
    if pv == "transposed":
        return torch.matmul(past_v.transpose(2, 3), probs.transpose(2, 3)).transpose(2, 3)
    if pv == "reduce":
        return (probs.unsqueeze(-1).float() * past_v.unsqueeze(2).float()).sum(3).to(past_v.dtype)
    return torch.matmul(probs, past_v)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h, kv, hd = config.hidden_size, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def input_projections(self) -> list[nn.Module]:
        return [getattr(self, n) for n in ("qkv_proj", "q_proj", "k_proj", "v_proj") if hasattr(self, n)]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past, past_v: Past,
                slot: Tensor | None = None, lengths: Tensor | None = None,
                x8: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """slot: None for the export formulation (past is the history, concatenated with the new K/V); else the
        (B, KV, T, hd) int64 write index of in-place cache mode (past is the cache view). lengths: a decode step's
        (B,) int32 visible slots per row (position + 1), where the caller computed them once for every layer; else
        a decode step computes them (from the slots on the Triton path, _in_place). x8: x's ACT8_FORMAT codes
        where its producer made them (`_takes_act8`)."""
        if hasattr(self, "qkv_proj"):  # fuse_projections: one weight read for the three
            qx, kx, vx = _proj(self.qkv_proj, x, x8).split(self.qkv_sizes, dim=-1)
        else:
            qx, kx, vx = _proj(self.q_proj, x, x8), _proj(self.k_proj, x, x8), _proj(self.v_proj, x, x8)
        out, k, v = self.attend(qx, kx, vx, cos, sin, mask, past_k, past_v, slot, lengths)
        return self.o_proj(out), k, v

    def attend(self, qx: Tensor, kx: Tensor, vx: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
               past_v: Past, slot: Tensor | None = None, lengths: Tensor | None = None,
               partials: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """`forward` from the q/k/v projections' outputs (B, T, .) to o_proj's input (B, T, H * hd), in qx's dtype,
        and (k, v) as forward returns them. partials: the split partials in place of o_proj's input (`merges_in_o`)."""
        b, t, _ = qx.shape
        if slot is not None:  # in-place cache mode: write, then attend over the cache view at model dtype
            return self._in_place(qx, kx, vx, cos, sin, mask, past_k, past_v, slot, lengths, partials)
        q, k, v = self._rotated(qx, kx, vx, cos, sin)
        if t == 1 and hasattr(past_k, "attend"):  # a DecodePast: the same attention, in its own kernels
            out = past_k.attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], past_v)  # (B, H, hd) fp32
            return out.to(qx.dtype).reshape(b, 1, -1), k, v
        keys = torch.cat((dense_past(past_k, k.dtype), k), dim=2)  # (B, KV, P + T, hd)
        values = torch.cat((dense_past(past_v, v.dtype), v), dim=2)
        # Grouped-query attention without copying K/V per query head: fold each KV head's group of
        # query heads into the row dimension, (B, H, T, hd) -> (B, KV, G * T, hd), row = g * T + t.
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(b, self.n_kv_heads, group * t, self.head_dim)
        if group > 1:
            mask = mask.repeat(1, 1, group, 1)  # (B, 1, G * T, P + T), rows ordered as q's
        scores = torch.matmul(q.float(), keys.float().transpose(2, 3)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + mask, dim=-1).to(values.dtype)  # (B, KV, G*T, P+T), fp32 softmax
        out = torch.matmul(probs, values)  # (B, KV, G * T, hd)
        out = out.reshape(b, self.n_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return out, k, v

    def _rotated(self, qx: Tensor, kx: Tensor, vx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The projections' outputs (B, T, .) as heads, q and k rotated: (B, H, T, hd), (B, KV, T, hd) twice."""
        b, t, _ = qx.shape
        q = qx.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = kx.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = vx.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _in_place(self, qx: Tensor, kx: Tensor, vx: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
                  past_v: Past, slot: Tensor, lengths: Tensor | None,
                  partials: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """In-place cache mode: RoPE on the T tokens' q and k, their K/V written into the cache views, then
        attention over the views: a decode step (T = 1) through decode_attention_dense (DECODE_PV), a prefill
        chunk through SDPA. Where the Triton kernels apply (ROPE_FUSED), the rotation and the write are one
        launch (kernels.rope_triton) and the caches come back in place of the new K/V (no gather kernels: every
        caller of in-place mode drops them), or, for a decode step under ROPE_IN_ATTENTION, the attention's own
        split kernel rotates and writes (kv_triton.dense_decode_attention_rope); else torch's ops (scatter_) and the
        new K/V."""
        b, t, _ = qx.shape
        group = self.n_heads // self.n_kv_heads
        if ROPE_FUSED and isinstance(past_k, Tensor) and _triton_decode_shapes(qx, self.head_dim, group):
            pos = slot[:, 0, :, 0]  # (B, T) the tokens' slots = their positions
            if t == 1 and lengths is None:
                lengths = (pos[:, 0] + 1).to(torch.int32)
            if t == 1 and ROPE_IN_ATTENTION:  # RoPE and the write in the attention's own kernel
                from kernels import kv_triton

                op = kv_triton.dense_decode_partials_rope if partials else kv_triton.dense_decode_attention_rope
                out = op(qx[:, 0].unflatten(-1, (self.n_heads, self.head_dim)), kx[:, 0], vx[:, 0], cos[:, 0, 0],
                         sin[:, 0, 0], past_k, past_v, lengths)
                return (out if partials else out.reshape(b, 1, -1)), past_k, past_v
            from kernels.rope_triton import rope_write

            q = rope_write(qx, kx, vx, cos[:, 0], sin[:, 0], pos, past_k, past_v)  # (B, H, T, hd)
            k, v = past_k, past_v
        else:
            q, k, v = self._rotated(qx, kx, vx, cos, sin)
            past_k.scatter_(2, slot, k)
            past_v.scatter_(2, slot, v)
        return self._attend_cache(q, mask, past_k, past_v, lengths, partials), k, v

    def _attend_cache(self, q: Tensor, mask: Tensor, past_k: Tensor, past_v: Tensor,
                      lengths: Tensor | None, partials: bool = False):
        """In-place cache mode's attention, q rotated (B, H, T, hd) and the T tokens' K/V already in the caches ->
        o_proj's input (B, T, H * hd); partials (a decode step, `merges_in_o`): the Triton decode kernel's split
        partials (o, m, l) instead, unmerged."""
        b, _, t, _ = q.shape
        if partials:
            from kernels.kv_triton import dense_decode_partials

            if lengths is None:
                raise ValueError("the attention's partials take the visible lengths (a decode step on CUDA)")
            return dense_decode_partials(q.reshape(b, self.n_heads, self.head_dim), past_k, past_v, lengths)
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(b, self.n_kv_heads, group * t, self.head_dim)  # the GQA fold of the export path
        if t == 1:  # decode: decode_attention_dense (DECODE_PV). SDPA's kernels run one block per KV head for G
            # query rows here (8 blocks for Llama-3-8B: 31 us a layer on an H200 against ~1 us of K/V traffic).
            out = decode_attention_dense(q, past_k, past_v, mask, lengths=lengths)
        else:
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(q, past_k, past_v, attn_mask=mask)  # mask (B, 1, G*T, L)
        return out.reshape(b, self.n_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)

    def _triton_decode_step(self, h: Tensor, past_k: Past, slot: Tensor | None) -> bool:
        """Whether h (B, T, D) is a decode step in in-place cache mode over a dense cache that the Triton decode
        kernels read."""
        return (slot is not None and h.shape[1] == 1 and isinstance(past_k, Tensor)
                and _triton_decode_shapes(h, self.head_dim, self.n_heads // self.n_kv_heads))

    def merges_in_o(self, h: Tensor, past_k: Past, slot: Tensor | None) -> bool:
        """Whether a decode step over h (B, 1, D) hands o_proj the attention's split partials to merge in its GEMV
        (MERGE_IN_O): `_triton_decode_step`, and an o_proj with the merge epilogue (QuantLinear.merge_epilogue)."""
        return MERGE_IN_O and self._triton_decode_step(h, past_k, slot) and hasattr(self.o_proj, "merge_epilogue")

    def rope_in_epilogue(self, h: Tensor, past_k: Past, slot: Tensor | None) -> bool:
        """Whether a decode step over h (B, 1, D) runs RoPE and the cache write in the q/k/v GEMV's epilogue
        (ROPE_EPILOGUE): in-place cache mode over a dense cache, where the Triton kernels apply, and a fused INT4
        q/k/v projection whose tiles hold whole heads (QuantLinear.takes_rope)."""
        qkv = getattr(self, "qkv_proj", None)
        return (ROPE_EPILOGUE and ROPE_FUSED and self._triton_decode_step(h, past_k, slot)
                and hasattr(qkv, "takes_rope") and qkv.takes_rope(h, self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def input_projections(self) -> list[nn.Module]:
        return [getattr(self, n) for n in ("gate_up_proj", "gate_proj", "up_proj") if hasattr(self, n)]

    def forward(self, x: Tensor, x8: Tensor | None = None) -> Tensor:
        """x8: x's ACT8_FORMAT codes where its producer made them (`_takes_act8`)."""
        if hasattr(self, "gate_up_proj"):  # fuse_projections
            gate_up = _proj(self.gate_up_proj, x, x8)
            if _fused_elementwise(gate_up):
                from kernels import norm_triton

                if _takes_act8([self.down_proj], gate_up):  # (gate_up has the rows of down_proj's input)
                    return self.down_proj(*norm_triton.silu_mul_a8(gate_up))
                return self.down_proj(norm_triton.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(_proj(self.gate_proj, x, x8)) * _proj(self.up_proj, x, x8))


def _cat_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight.data for p in parts], 0)
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    fused.weight.data.copy_(w)
    if fused.bias is not None:
        fused.bias.data.copy_(torch.cat([p.bias.data for p in parts], 0))
    return fused


def fuse_quantized_projections(model: nn.Module) -> int:
    """`fuse_projections` for a model whose projections are CUDA INT4 QuantLinears on the Triton GEMV
    (kernels.int4_triton): each layer's q/k/v and gate/up stacked into one layer each, codes repacked, in place,
    for running (the fused model's state dict is not a checkpoint's). A batch-1 decode step then makes 2 weight
    calls a layer instead of 5 (Llama-3-8B INT4 on an H200: +3.5 % decode in the compiled step, docs/BENCHMARKS.md).
    Layers on any other kernel are left as they are. Returns the number of layers fused."""
    from kernels.weight_only import QuantLinear

    fused = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        parts = [getattr(a, "q_proj", None), getattr(a, "k_proj", None), getattr(a, "v_proj", None),
                 getattr(m, "gate_proj", None), getattr(m, "up_proj", None)]
        if not all(isinstance(p, QuantLinear) and p.kernel == "int4_triton" and p.bias is None for p in parts):
            continue
        a.qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        a.qkv_proj = QuantLinear.concat([a.q_proj, a.k_proj, a.v_proj])
        m.gate_up_proj = QuantLinear.concat([m.gate_proj, m.up_proj])
        del a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj
        fused += 1
    return fused


def fuse_projections(model: nn.Module) -> nn.Module:
    """Each layer's q/k/v projections into one `qkv_proj` and gate/up into one `gate_up_proj` (their weights'
    rows concatenated: the same function), in place, before any quantisation (a group-wise quantiser treats rows
    alike, so the fused codes are the separate ones stacked). A batch-1 decode step then reads those weights in
    two calls a layer instead of five. The fused model is for running: its state dict is not a checkpoint's."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not isinstance(a.q_proj, nn.Linear) or not isinstance(m.gate_proj, nn.Linear):
            raise TypeError("fuse_projections works on float nn.Linear layers: fuse before quantising")
        a.qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        a.qkv_proj = _cat_linear([a.q_proj, a.k_proj, a.v_proj])
        m.gate_up_proj = _cat_linear([m.gate_proj, m.up_proj])
        del a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj
    return model


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
                past_v: Past, slot: Tensor | None = None, lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        x, mlp_out, k, v = self.run_pending(x, None, cos, sin, mask, past_k, past_v, slot, lengths)
        return x + mlp_out, k, v

    def run_pending(self, x: Tensor, pending: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
                    past_v: Past, slot: Tensor | None = None,
                    lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer on the residual stream x + pending (pending: the previous layer's MLP output, not yet added,
        or None), returning (the stream after attention, this layer's MLP output, k, v): each residual add runs
        inside the norm that reads it (one kernel on CUDA), so the caller adds the last MLP output itself."""
        held = self._hold_int4(x)
        if not held:  # (no try block for torch.compile to trace in a decode step)
            return self._run(x, pending, cos, sin, mask, past_k, past_v, slot, lengths)
        from kernels.weight_only import release_prefill_weights

        try:
            return self._run(x, pending, cos, sin, mask, past_k, past_v, slot, lengths)
        finally:
            release_prefill_weights(held)

    def _run(self, x: Tensor, pending: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
             past_v: Past, slot: Tensor | None, lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        normed, x, x8 = self.input_layernorm.norm(x, pending, _takes_act8(self.self_attn.input_projections(), x))
        a, k, v = self.self_attn(normed, cos, sin, mask, past_k, past_v, slot, lengths, x8)
        normed, x, x8 = self.post_attention_layernorm.norm(x, a, _takes_act8(self.mlp.input_projections(), x))
        return x, self.mlp(normed, x8), k, v

    def run_epilogues(self, h: Tensor, hg: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Past,
                      past_v: Past, slot: Tensor | None, lengths: Tensor | None,
                      next_weight: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """A decode step of the layer with its norms, residual adds and SiLU * up inside the INT4 GEMVs' epilogues
        (`_gemv_epilogues` says where): h the residual stream, hg = h * input_layernorm's weight (the previous
        layer's down_proj made it). Returns (the stream after the layer, it times next_weight or None, k, v).
        With quantised activations (kernels.int4_triton ACT "int8" / "int16") hg is its ACT8_FORMAT codes, and each
        epilogue writes the codes of the next GEMV's input (QuantLinear.epilogue): q/k/v, gate/up and down_proj
        take codes, o_proj the attention's output as it is (a quantise launch a layer fewer)."""
        a, m = self.self_attn, self.mlp
        merge = a.merges_in_o(h, past_k, slot)
        if a.rope_in_epilogue(h, past_k, slot):  # RoPE and the cache write in the q/k/v GEMV's epilogue too
            pos = slot[:, 0, 0, 0]  # (B,) the token's slot = its position
            q = a.qkv_proj.rope_epilogue(hg, h, self.input_layernorm.eps, cos[:, 0, 0], sin[:, 0, 0], pos, past_k,
                                         past_v, a.n_heads, dtype=h.dtype)
            if lengths is None:
                lengths = (pos + 1).to(torch.int32)
            b = q.shape[0]
            out = a._attend_cache(q.view(b, a.n_heads, 1, a.head_dim), mask, past_k, past_v, lengths, merge)
            k, v = past_k, past_v
        else:
            qkv, _ = a.qkv_proj.epilogue(hg, rms_of=h, eps=self.input_layernorm.eps, dtype=h.dtype)
            out, k, v = a.attend(*qkv.split(a.qkv_sizes, dim=-1), cos, sin, mask, past_k, past_v, slot, lengths,
                                 merge)
        if merge:  # out: the attention's split partials, merged inside o_proj's GEMV
            h, hg = a.o_proj.merge_epilogue(out, h, self.post_attention_layernorm.weight, h.dtype)
        else:
            h, hg = a.o_proj.epilogue(out, residual=h, next_weight=self.post_attention_layernorm.weight)
        act, act8 = m.gate_up_proj.epilogue(hg, rms_of=h, eps=self.post_attention_layernorm.eps, silu=True,
                                            dtype=h.dtype)
        h, hg = m.down_proj.epilogue(act if act8 is None else act8, residual=h, next_weight=next_weight,
                                     dtype=h.dtype)
        return h, hg, k, v

    def _hold_int4(self, x: Tensor) -> list:
        """A prefill chunk on CUDA INT4 weights (kernels.int4_triton): the layer's weights dequantised in one launch
        and held for this call (kernels.weight_only.hold_prefill_weights), instead of one launch per projection;
        the launches, not the GPU, bound an 8B INT4 prefill on the H200's host. [] for anything else, and where
        the weights are already held (the slice's kernels.weight_only.LayerPrefetch dequantised them ahead)."""
        down = self.mlp.down_proj
        if (getattr(down, "kernel", None) != "int4_triton" or x.shape[0] * x.shape[1] <= INT4_GEMV_MAX_M
                or down.prefill_weight is not None):
            return []
        from kernels.weight_only import hold_prefill_weights

        return hold_prefill_weights(self.projections(), x.shape[0] * x.shape[1], x.dtype)

    def projections(self) -> list[nn.Module]:
        """The layer's linear layers, in the order they run (fused or not: fuse_projections)."""
        a, m = self.self_attn, self.mlp
        linears = [getattr(a, n) for n in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj") if hasattr(a, n)]
        return linears + [getattr(m, n) for n in ("gate_up_proj", "gate_proj", "up_proj") if hasattr(m, n)] + [
            m.down_proj]


class Backbone(nn.Module):
    """`model.*` in a Hugging Face checkpoint: embedding, decoder layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """The whole causal LM. It is only a container of weights: every forward pass goes through a
    `SliceModule` (the whole model is the slice [0, n_layers))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def slice(self, start: int, end: int, all_logits: bool = False) -> "SliceModule":
        return SliceModule(self, start, end, all_logits=all_logits)


class SliceModule(nn.Module):
    """Layers [start, end) of a Transformer, sharing its weights.

    forward(x, positions, *past) -> (out, *new):
      x          int32 token ids (B, T) for the first slice, else hidden states (B, T, D)
      positions  int32 (B, T), absolute positions of the T new tokens
      past       per layer past_k, past_v, each (B, KV, P, hd)
      out        logits (B, 1, V) of the last position (B, T, V with all_logits) for the last slice,
                 else hidden states (B, T, D)
      new        per layer new_k, new_v, each (B, KV, T, hd)
    """

    def __init__(self, model: Transformer, start: int, end: int, all_logits: bool = False) -> None:
        super().__init__()
        n = model.config.n_layers
        if not 0 <= start < end <= n:
            raise ValueError(f"slice {start}:{end} is not a non-empty layer range inside 0:{n}")
        self.config = model.config
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == n
        self.all_logits = all_logits
        self.embed_tokens = model.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(model.model.layers[start:end])
        self.norm = model.model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def _layers(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Past, ...], slot: Tensor | None,
                lengths: Tensor | None, fused: bool, ahead, new: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """The decoder layers on h, each layer's (k, v) appended to `new`; returns (h, the last MLP output not
        yet added or None). ahead: the INT4 prefill's kernels.weight_only.LayerPrefetch, or None."""
        pending: Tensor | None = None
        if fused and _gemv_epilogues(self.layers, h):  # a decode step over INT4 layers: the GEMVs' epilogues
            first = self.layers[0].input_layernorm.weight
            from kernels import int4_triton

            codes = int4_triton.act_mode(h.dtype) != "exact"  # the first q/k/v takes codes (run_epilogues)
            if codes and LEAN_PROLOGUE:  # the codes of h * first in one launch
                hg = int4_triton.act8_quant(h.reshape(-1, h.shape[-1]), int4_triton.act_bits(h.dtype),
                                            weight=first).reshape(*h.shape[:-1], -1)
            else:
                hg = (h.float() * first.float()).to(h.dtype)
                if codes:
                    hg = int4_triton.act8_quant(hg.reshape(-1, hg.shape[-1]), int4_triton.act_bits(h.dtype)).reshape(
                        *hg.shape[:-1], -1)
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else None
                h, hg, k, v = layer.run_epilogues(h, hg, cos, sin, mask, past[2 * i], past[2 * i + 1], slot,
                                                  lengths, nxt)
                new += (k, v)
            return h, None
        for i, layer in enumerate(self.layers):
            if ahead is not None:
                ahead.begin(i)
            if fused:
                h, pending, k, v = layer.run_pending(h, pending, cos, sin, mask, past[2 * i], past[2 * i + 1], slot,
                                                     lengths)
            else:
                h, k, v = layer(h, cos, sin, mask, past[2 * i], past[2 * i + 1], slot, lengths)
            if ahead is not None:
                ahead.done(i)
            new += (k, v)
        return h, pending

    def forward(self, x: Tensor, positions: Tensor, *past: Past) -> tuple[Tensor, ...]:
        """The graph that is exported: inputs and outputs only, no options (the legacy ONNX exporter
        turns keyword defaults into extra positional inputs)."""
        return self.run(x, positions, *past)

    def run(self, x: Tensor, positions: Tensor, *past: Past, cache_in_place: bool = False,
            all_logits: bool | None = None) -> tuple[Tensor, ...]:
        """`forward` with the runtime options. cache_in_place: past are cache views written in place
        (module docstring); False = export path. all_logits: override the slice's setting for this call
        (speculative verification needs every position's logits from a slice built for decode)."""
        if len(past) != 2 * self.n_layers:
            raise ValueError(f"slice {self.start}:{self.end} takes {2 * self.n_layers} past tensors, got {len(past)}")
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, D)
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
        slot: Tensor | None = None
        lengths: Tensor | None = None
        if cache_in_place:
            b, t = positions.shape
            kv, hd = past[0].shape[1], past[0].shape[3]
            group = self.config.n_heads // self.config.n_kv_heads
            slot = positions.long()[:, None, :, None].expand(b, kv, t, hd)
            # a decode step whose every layer attends through the Triton decode kernel, which reads lengths: no mask
            # (LEAN_PROLOGUE)
            triton_decode = (LEAN_PROLOGUE and t == 1 and all(isinstance(p, Tensor) for p in past)
                             and _triton_decode_shapes(h, hd, group))
            if triton_decode or (t == 1 and h.is_cuda):  # the decode kernels' visible slots, once a step
                lengths = (positions[:, 0] + 1).to(torch.int32)
            mask = None if triton_decode else cache_mask(positions, past[0].shape[2], h.dtype).repeat(1, 1, group, 1)
        else:
            mask = attention_mask(positions, past[0].shape[2])
        new: list[Tensor] = []
        # With the fused kernels, each layer's MLP output is added inside the next norm (DecoderLayer.run_pending);
        # otherwise (the CPU, the ONNX export) each layer is called as a module, so the exported graph and its node
        # names (the TensorRT precision plan keeps "/layers.N/Add" in fp32) stay as they are.
        fused = _fused_elementwise(h)
        ahead = _int4_prefetch(self.layers, h) if fused else None
        if ahead is None:  # (no try block for torch.compile to trace in a decode step)
            h, pending = self._layers(h, cos, sin, mask, past, slot, lengths, fused, None, new)
        else:
            try:
                h, pending = self._layers(h, cos, sin, mask, past, slot, lengths, fused, ahead, new)
            finally:
                ahead.close()
        if self.lm_head is not None:
            if not (self.all_logits if all_logits is None else all_logits):
                h = h[:, -1:]  # prefill needs the next token only: skip T x vocab logits
                pending = pending[:, -1:] if pending is not None else None
            normed, _, x8 = self.norm.norm(h, pending, _takes_act8([self.lm_head], h))
            return (_proj(self.lm_head, normed, x8).float(), *new)  # (B, 1 or T, V)
        return (h if pending is None else h + pending, *new)
