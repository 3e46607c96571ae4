"""The whole decoder as one ONNX Runtime graph of contrib operators, built from the weights directly
(onnx.helper, no tracing), for the CPU decode path that streams block-quantised weights:
`com.microsoft` MatMulNBits (INT4 / INT8 weights, int8 activations at accuracy_level 4),
GroupQueryAttention (rotary inside, the KV-cache updated in place), SkipSimplifiedLayerNormalization
(residual add + RMSNorm in one node) and GatherBlockQuantized (a Q8_0 embedding looked up as codes).
These are the operators onnxruntime-genai's model builder emits for CPU (its builder.py); this module
writes the same structure from the project's weights. Per layer: 1 norm, 1 fused QKV projection,
GQA, o_proj, 1 norm, 1 fused gate/up projection, SiLU * up, down_proj (plus 3 small nodes per
projection whose weights carry a float group minimum, kernels/matmul_nbits.py: offset_matmul_nodes).
At "native" precision (ACCURACY_NATIVE) kernels/ort_q4.c's operators take their place where they apply:
Q4MatMul / Q4MatMulSkipNorm for the projections (the residual add and the next norm inside), and
CacheAttention for GQA (its inputs, outputs and arithmetic, on the operator's thread team).

Graph contract (partition/runners/ort_decoder_runner.py binds it):
  inputs   input_ids int32 (B, T); seqlens_k int32 (B,) = last new position per row;
           total_sequence_length int32 () = max over rows of seqlens_k + 1;
           past_key_{i}, past_value_{i} float32 (B, KV, S, hd), S = the cache length
  outputs  logits float32 (B, 1, V) of each row's last position;
           present_key_{i}, present_value_{i} float32 (B, KV, S, hd): the runner binds them to the
           same buffers as the past, and GQA then writes the T new K/V into them by position
           (its past_present_share_buffer mode: contrib_ops/cpu/bert/gqa_attention_base.h).
Positions are implicit: row b's T new tokens sit at seqlens_k[b] + 1 - T ... seqlens_k[b], and the
row attends to slots [0, seqlens_k[b]] (the same rule as partition/model.py's masks).

Weights come in as numpy (`DecoderWeights`): a linear is a float32 (N, K) array or a `QuantWeight`
(codes, scales and integer zero points or float minimums per group; the canonical form of
kernels/weight_only.py and partition/gguf/quants.py). `weights_from_model` reads them off a torch
Transformer (QuantLinear on its reference path, or nn.Linear); GGUF files go through
partition.gguf without torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from kernels.matmul_nbits import ACCURACY_FP32, ACCURACY_INT8, BLOCK_SIZES, MS_DOMAIN, matmul_nbits_node, nbits_weight, \
    offset_matmul_nodes
from partition.config import ModelConfig

OPSET = 17
IR_VERSION = 8
# accuracy level (this module's own, beside MatMulNBits' 0 and 4): int8 kernels on split activations, x = x_hi + x_lo
# with x_hi exactly on the kernel's int8 grid and x_lo the residual (`_Graph._split_input`)
ACCURACY_SPLIT = -4
# and the exact 4- and 8-bit custom operator of kernels/ort_q4.c (fp32 activations, a node per projection, the MLP's
# activation inside the gate/up node, o and down with the residual add and the next norm): a graph at this level
# needs that library registered in its session
ACCURACY_NATIVE = -5


@dataclass(frozen=True)
class QuantWeight:
    """Group-wise weight-only codes: w = (q - z) * s, or q * s + m with float minimums."""

    bits: int
    codes: np.ndarray  # uint8 (N, K)
    scales: np.ndarray  # float32 (N, G)
    zeros: np.ndarray | None = None  # int (N, G)
    mins: np.ndarray | None = None  # float32 (N, G)
    group: int = 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        q = self.codes.astype(np.float32).reshape(n, k // self.group, self.group)
        s = self.scales.astype(np.float32)[..., None]
        w = q * s + self.mins[..., None] if self.mins is not None else (q - self.zeros[..., None]) * s
        return w.reshape(n, k)


Linear = Union[np.ndarray, QuantWeight]


@dataclass
class LayerWeights:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    qkv_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass
class DecoderWeights:
    config: ModelConfig
    embed: Linear  # (V, D): a lookup table (codes or floats)
    layers: list[LayerWeights]
    norm: np.ndarray
    head: Linear | None = None  # None: tied to the embedding
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def as_quant(u: Any, group: int = 32) -> QuantWeight:
    """Any object with bits / codes / scales / zeros / mins (partition.gguf.quants.Unpacked) as a QuantWeight."""
    return QuantWeight(int(u.bits), np.ascontiguousarray(u.codes, np.uint8), np.ascontiguousarray(u.scales, np.float32),
                       None if u.zeros is None else np.ascontiguousarray(u.zeros),
                       None if u.mins is None else np.ascontiguousarray(u.mins, np.float32), group)


def rope_inv_freq_np(config: ModelConfig) -> np.ndarray:
    """partition.model.rope_inv_freq in numpy float32 (tests check they agree), so this module needs no torch."""
    dim = config.head_dim
    inv = (1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv
    low = rs.original_max_position_embeddings / rs.low_freq_factor
    high = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low, inv / rs.factor, inv).astype(np.float32)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high) & (wavelen <= low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cache(config: ModelConfig, max_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """GQA's cos_cache / sin_cache (max_seq, head_dim / 2), float32, as partition.model.rope_cos_sin forms them
    (positions in float32 times the inverse frequencies)."""
    freqs = np.arange(max_seq, dtype=np.float32)[:, None] * rope_inv_freq_np(config)[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _concat(parts: list[Linear]) -> Linear | None:
    """Fuse projections that read the same input (QKV, gate/up) along N when they share one form."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)
    if not all(isinstance(p, QuantWeight) for p in parts):
        return None
    first = parts[0]
    assert isinstance(first, QuantWeight)
    same = all(p.bits == first.bits and p.group == first.group and (p.mins is None) == (first.mins is None)
               for p in parts)  # type: ignore[union-attr]
    if not same:
        return None
    cat = (lambda name: None if getattr(first, name) is None else np.concatenate([getattr(p, name) for p in parts], 0))
    return QuantWeight(first.bits, cat("codes"), cat("scales"), cat("zeros"), cat("mins"), first.group)


class _Graph:
    """Nodes and initialisers under construction."""

    def __init__(self, accuracy_level: int | dict[str, int]) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.levels = dict(accuracy_level) if isinstance(accuracy_level, dict) else {}
        self.split_cache: dict[str, tuple[str, str]] = {}
        self.native = False  # whether a node of kernels/ort_q4.c's operators was added
        self.native_projections = 0  # of them, the projections (Q4MatMul, Q4MatMulSkipNorm)
        self.default_level = (accuracy_level if isinstance(accuracy_level, int)
                              else self.levels.get("default", ACCURACY_INT8))

    def level(self, prefix: str) -> int:
        """MatMulNBits' accuracy level for a projection: by its kind (the prefix's last part: qkv, o, gate_up, down,
        lm_head), else the default."""
        if prefix in self.levels:  # a projection by name (layers.3.down)
            return self.levels[prefix]
        layer = prefix.rsplit(".", 1)[0]
        if layer in self.levels:  # every projection of a layer (layers.3)
            return self.levels[layer]
        return self.levels.get(prefix.rsplit(".", 1)[-1], self.default_level)

    def const(self, name: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs: Any) -> None:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))

    def add(self, built: tuple[list, list]) -> None:
        self.nodes += built[0]
        self.inits += built[1]

    def linear(self, prefix: str, x: str, y: str, w: Linear, bias: np.ndarray | None = None, rank: int = 3) -> None:
        """y = x @ w^T (+ bias) through the kernel the weight's form calls for: MatMul for floats,
        MatMulNBits for codes with integer zero points, MatMulNBits + the block-sum term for float minimums."""
        out = y if bias is None else f"{prefix}.nobias"
        if isinstance(w, np.ndarray):
            self.node("MatMul", [x, self.const(f"{prefix}.weightT", np.asarray(w, np.float32).T)], [out], prefix)
        else:
            if w.group not in BLOCK_SIZES:
                raise ValueError(f"{prefix}: MatMulNBits takes groups of {BLOCK_SIZES}; this weight has groups "
                                 f"of {w.group}")
            level = self.level(prefix)
            if level == ACCURACY_NATIVE and self._native_linear(prefix, x, out, w):
                pass  # else (a shape or scales the operator does not take): as split, below
            elif (level in (ACCURACY_SPLIT, ACCURACY_NATIVE)
                  or (w.bits == 8 and w.mins is None and level != ACCURACY_INT8)):
                # 8-bit codes with fp32 activations: MLAS's 8-bit fp32 path dequantises every call, and the
                # nibble split below reads the codes twice; the split input through its int8 kernel is 1.44x the
                # nibble split on the shipped model's Q8_0 (555 -> 800 tok/s, 2 threads) with greedy tokens
                # equal to the dequantised model's on all 1584 teacher-forced positions of two texts
                self._split_linear(prefix, x, out, w, rank)
            elif w.bits == 8 and level != ACCURACY_INT8:
                self._int8_as_two_int4(prefix, x, out, w, rank, level)
            elif w.mins is not None:
                self.add(offset_matmul_nodes(prefix, x, out, w.codes, w.scales, w.mins, w.bits, w.group, rank, level))
            else:
                self.add(matmul_nbits_node(prefix, x, out, nbits_weight(w.codes, w.scales, w.zeros, w.bits, w.group),
                                           self.level(prefix)))
        if bias is not None:
            self.node("Add", [out, self.const(f"{prefix}.bias", np.asarray(bias, np.float32))], [y], f"{prefix}.add")

    def native_level(self, prefix: str, w: object) -> bool:
        """Whether projection `prefix`'s weight w is asked for at native precision (a quantised weight at level
        ACCURACY_NATIVE): then `_native_linear` / `_native_skip_norm` try the operator, which may still not take it."""
        return isinstance(w, QuantWeight) and self.level(prefix) == ACCURACY_NATIVE

    def _native_linear(self, prefix: str, x: str, y: str, w: QuantWeight, glu: bool = False, int8: bool = False
                       ) -> bool:
        """y = x @ w^T through orin_agent.Q4MatMul (kernels/ort_q4.c), for a 4- or 8-bit weight of a shape and scales
        it takes; False (nothing added) otherwise. glu: w is gate rows then up rows, and y = silu(gate) * up. int8: its
        int8-activation form, not exact (a rescored head's candidates)."""
        from kernels import ort_q4

        n, k = w.codes.shape
        if (int8 and w.bits != 4) or not ort_q4.accepts(n, k, w.bits, w.group, w.scales, w.mins, w.zeros, glu):
            return False  # e.g. scales half precision would round: not this operator's weight
        packed = ort_q4.pack(w.codes, w.scales, w.mins, w.zeros, int8=int8, bits=w.bits)
        if glu:
            order = ort_q4.glu_rows(n // 2)
            packed = ort_q4.Q4Weight(packed.codes[order], packed.scales[order], packed.mins[order], packed.int8)
        self.node(ort_q4.OP, [x, self.const(f"{prefix}.q4codes", packed.codes),
                              self.const(f"{prefix}.q4scales", packed.scales),
                              self.const(f"{prefix}.q4mins", packed.mins)], [y], prefix, domain=ort_q4.DOMAIN,
                  **({"glu": 1} if glu else {}), **({"int8": 1} if int8 else {}))
        self.native = True
        self.native_projections += 1
        return True

    def attention(self, prefix: str, qkv: str, past: list[str], present: list[str], heads: int, kv_heads: int,
                  head_dim: int) -> None:
        """A layer's attention over its KV-cache (the graph contract in the module docstring): onnxruntime's
        GroupQueryAttention, or at native precision kernels/ort_q4.c's CacheAttention, the same inputs and
        arithmetic (RoPE, the in-place cache write, fp32 softmax) on the operator's thread team (SmolLM2's
        shape, 2 threads, 100 slots: 7.5 against 20.3 us a layer; docs/BENCHMARKS.md, nineteenth session)."""
        args = [qkv, *past, "seqlens_k", "total_sequence_length", "rope.cos", "rope.sin"]
        attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": 1.0 / math.sqrt(head_dim)}
        if self.level(prefix) == ACCURACY_NATIVE:
            from kernels import ort_q4

            self.node(ort_q4.ATTENTION_OP, args, [prefix, *present], prefix, domain=ort_q4.DOMAIN, **attrs)
            self.native = True
        else:
            self.node("GroupQueryAttention", [qkv, "", "", *args[1:]], [prefix, *present], prefix, domain=MS_DOMAIN,
                      do_rotary=1, rotary_interleaved=0, **attrs)

    def _native_skip_norm(self, prefix: str, x: str, w: QuantWeight, skip: str, gamma: str, eps: float, out: str,
                          sum_out: str) -> bool:
        """out, sum_out = SkipSimplifiedLayerNormalization(x @ w^T, skip, gamma) as one
        orin_agent.Q4MatMulSkipNorm node (the projection, the residual add and the next RMSNorm), for a weight the
        operator takes; False (nothing added) otherwise."""
        if not self._native_linear(prefix, x, sum_out, w):
            return False
        node = self.nodes[-1]  # the plain Q4MatMul just added, made the fused one
        from kernels.ort_q4 import SKIP_NORM_OP

        node.op_type = SKIP_NORM_OP
        node.input.extend([skip, gamma])
        del node.output[:]
        node.output.extend([out, sum_out])
        from onnx import helper

        node.attribute.append(helper.make_attribute("epsilon", float(eps)))
        return True

    def _split_input(self, x: str, k: int, block: int, rank: int) -> tuple[str, str]:
        """x (..., K) -> (x in blocks (..., K / block, block), [x; x_lo] concatenated along the row axis).
        MatMulNBits' int8 path (accuracy_level 4) rounds a block of x to x_hi = round(x / s) * s, s = max|x| / 127
        (MLAS's QuantizeARow); x_lo = x - x_hi (|x_lo| <= s / 2) is built here on the same grid, so the row pair
        [x; x_lo] through that path loses only x_lo's own int8 rounding, ~1/254 of plain int8 activations' error.
        x goes in itself (the kernel finds the same x_hi), so no x_hi is reshaped or copied; the pair is joined
        in block form and flattened once. Built once per input tensor: 11 nodes."""
        key = f"{x}.split{block}"
        if key in self.split_cache:
            return self.split_cache[key]
        lead = [0] * (rank - 1)
        xb, ab, mx, sc, sc1 = (f"{key}.{n}" for n in ("xb", "abs", "max", "s", "s1"))
        self.node("Reshape", [x, self.const(f"{key}.blocks", np.array(lead + [k // block, block], np.int64))], [xb],
                  f"{key}.reshape")
        self.node("Abs", [xb], [ab], f"{key}.abs")
        self.node("ReduceMax", [ab], [mx], f"{key}.amax", axes=[-1], keepdims=1)
        self.node("Mul", [mx, self.const(f"{key}.inv127", np.array(1 / 127, np.float32))], [sc1], f"{key}.scale")
        self.node("Max", [sc1, self.const(f"{key}.tiny", np.array(1e-30, np.float32))], [sc], f"{key}.scale_floor")
        self.node("Div", [xb, sc], [f"{key}.q"], f"{key}.div")
        self.node("Round", [f"{key}.q"], [f"{key}.k"], f"{key}.round")
        self.node("Mul", [f"{key}.k", sc], [f"{key}.hib"], f"{key}.hi")
        self.node("Sub", [xb, f"{key}.hib"], [f"{key}.lob"], f"{key}.lo")
        # rows axis: -3 of the block form (..., T, G, block); flattened back to (..., 2T, K)
        self.node("Concat", [xb, f"{key}.lob"], [f"{key}.catb"], f"{key}.concat", axis=-3)
        flat = self.const(f"{key}.flat", np.array([0] * (rank - 2) + [-1, k], np.int64))
        self.node("Reshape", [f"{key}.catb", flat], [f"{key}.cat"], f"{key}.cat_reshape")
        self.split_cache[key] = (xb, f"{key}.cat")
        return self.split_cache[key]

    def _split_linear(self, prefix: str, x: str, y: str, w: Linear, rank: int) -> None:
        """y = x @ w^T at ACCURACY_SPLIT (and for 8-bit codes with fp32 activations): one MatMulNBits (int8 path)
        over [x; x_lo] (two rows per row of x, one read of the weights), the halves summed; a 4-bit weight's
        float minimum as a block-sum term on x itself, in fp32, summed in the same node."""
        assert isinstance(w, QuantWeight) and (w.bits == 4 or w.mins is None)
        n, k = w.codes.shape
        xb, cat = self._split_input(x, k, w.group, rank)
        if w.mins is not None:
            s, r = w.scales.astype(np.float32), (w.mins + 8 * w.scales).astype(np.float32)
            nb = nbits_weight(w.codes, s, None, 4, w.group)
        else:
            nb, r = nbits_weight(w.codes, w.scales, w.zeros, w.bits, w.group), None
        self.add(matmul_nbits_node(prefix, cat, f"{prefix}.both", nb, ACCURACY_INT8))
        self.node("Split", [f"{prefix}.both"], [f"{prefix}.hi_y", f"{prefix}.lo_y"], f"{prefix}.split", axis=rank - 2)
        terms = [f"{prefix}.hi_y", f"{prefix}.lo_y"]
        if r is not None:
            self.node("ReduceSum", [xb, self.const(f"{prefix}.last_axis", np.array([-1], np.int64))], [f"{prefix}.xsum"],
                      f"{prefix}.blocksum", keepdims=0)
            self.node("MatMul", [f"{prefix}.xsum", self.const(f"{prefix}.offsetT", np.ascontiguousarray(r.T))],
                      [f"{prefix}.off"], f"{prefix}.offset_mm")
            terms.append(f"{prefix}.off")
        self.node("Sum", terms, [y], f"{prefix}.sum")

    def _int8_as_two_int4(self, prefix: str, x: str, y: str, w: QuantWeight, rank: int, level: int) -> None:
        """An 8-bit weight with fp32 activations. MatMulNBits has no prepacked fp32 kernel for 8 bits in
        onnxruntime 1.32 (it dequantises every call: 150 ms for a 49152 x 576 head here), so the codes
        u = 16 a + b are split into nibbles, exactly: w = s (u - z) = 16 s (a - 8) + [s b + s (128 - z)],
        one 4-bit MatMulNBits on the high nibbles and one with a float minimum on the low ones."""
        u = w.codes.astype(np.uint8)
        z = (w.zeros if w.zeros is not None else np.zeros_like(w.scales)).astype(np.float32)
        s = w.scales.astype(np.float32)
        mins = (w.mins.astype(np.float32) + 128 * s) if w.mins is not None else s * (128 - z)
        self.add(matmul_nbits_node(f"{prefix}.hi", x, f"{prefix}.hi_out",
                                   nbits_weight(u >> 4, 16 * s, None, 4, w.group), level))
        self.add(offset_matmul_nodes(f"{prefix}.lo", x, f"{prefix}.lo_out", u & 0xF, s, mins, 4, w.group, rank, level))
        self.node("Add", [f"{prefix}.hi_out", f"{prefix}.lo_out"], [y], f"{prefix}.sum")


def _embedding(g: _Graph, w: Linear, ids: str, out: str) -> None:
    """Token lookup: GatherBlockQuantized over INT8 codes with integer zero points (Q8_0), else a float Gather."""
    if isinstance(w, QuantWeight) and w.bits == 8 and w.mins is None and w.group in BLOCK_SIZES:
        assert w.zeros is not None
        g.node("GatherBlockQuantized",
               [g.const("embed.codes", w.codes.astype(np.uint8)), ids, g.const("embed.scales", w.scales.astype(np.float32)),
                g.const("embed.zero_points", w.zeros.astype(np.uint8))], [out], "embed", domain=MS_DOMAIN,
               bits=8, block_size=w.group, gather_axis=0, quantize_axis=1)
        return
    table = w.dequantize() if isinstance(w, QuantWeight) else np.asarray(w, np.float32)
    g.node("Gather", [g.const("embed.weight", table.astype(np.float32)), ids], [out], "embed", axis=0)


def _gatherable(w: Linear) -> bool:
    return isinstance(w, QuantWeight) and w.bits == 8 and w.mins is None and w.group in BLOCK_SIZES


# Group of the head's 4-bit candidate copy where the hidden size allows it (else the head's own): its scales are a
# sixteenth of its bytes at 32 and an eighth fewer at 64; SmolLM2-135M decoded 75.9 -> 78.6 tok/s (median of 7
# interleaved rounds, 2 threads) with greedy tokens unchanged on all 2137 positions of scripts/greedy_agreement.py.
CANDIDATE_GROUP = 64


def candidate_head(head: QuantWeight, half: bool = False) -> QuantWeight:
    """A 4-bit symmetric copy of an 8-bit head (groups of CANDIDATE_GROUP, scale = max |w| / 7, codes q - 8 in
    -7..7) that only picks the candidates _rescored_head recomputes exactly: ~0.56 bytes a weight instead of
    1 + 4 / group, the largest single read of a small model's step (SmolLM2's tied head: 28.3 M weights).
    half: scales rounded to half precision first (the native operator's form; the codes follow the rounded scale)."""
    w = head.dequantize()
    n, k = w.shape
    group = CANDIDATE_GROUP if k % CANDIDATE_GROUP == 0 else head.group
    blocks = w.reshape(n, k // group, group)
    scale = np.abs(blocks).max(-1) / 7
    scale[scale == 0] = 1.0  # an all-zero block: any scale reproduces it
    if half:
        # (clipped to half precision's normal range: no zero, no subnormal, no infinity)
        scale = np.clip(scale, 6.1e-5, 65504).astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint(blocks / scale[..., None]), -7, 7) + 8
    return QuantWeight(4, codes.reshape(n, k).astype(np.uint8), scale.astype(np.float32), None, None, group)


def _rescored_head(g: _Graph, head: QuantWeight, tied: bool, k: int) -> None:
    """The output head in two passes: candidates from a 4-bit copy of the head with int8 activations
    (`candidate_head`, MatMulNBits accuracy_level 4, the fast kernel over half the bytes), then the k highest
    logits recomputed exactly in fp32 from the head's own 8-bit rows (GatherBlockQuantized of its codes, a dot
    product with the normed hidden state) and written back. The greedy token is the exact one whenever it is
    among the candidates' top k (the 4-bit copy's error is a fraction of a logit; k = 32 spans several logits),
    and every logit a sampler could draw at any useful temperature is exact; the rest keep the copy's error."""
    saved = g.levels.get("lm_head")
    # the candidates: MLAS's int8 kernel, or under the native operator (whose session runs ONNX Runtime on one thread)
    # that operator's int8-activation form on its own team, with the copy's scales in half precision
    native = g.level("lm_head") == ACCURACY_NATIVE
    cand = candidate_head(head, half=native)
    if not (native and g._native_linear("lm_head", "hn", "logits_candidates", cand, int8=True)):
        g.levels["lm_head"] = ACCURACY_INT8
        g.linear("lm_head", "hn", "logits_candidates", cand)
    g.levels.pop("lm_head", None)
    if saved is not None:
        g.levels["lm_head"] = saved
    names = (("embed.codes", "embed.scales", "embed.zero_points") if tied else
             ("lm_head.codes", "lm_head.rows_scales", "lm_head.rows_zero_points"))
    if not tied:
        g.const(names[0], head.codes.astype(np.uint8))
        g.const(names[1], head.scales.astype(np.float32))
        g.const(names[2], head.zeros.astype(np.uint8))  # type: ignore[union-attr]
    g.node("TopK", ["logits_candidates", g.const("rescore.k", np.array([k], np.int64))], ["top_values", "top_ids"],
           "rescore.topk", axis=-1, largest=1, sorted=0)
    g.node("GatherBlockQuantized", [names[0], "top_ids", names[1], names[2]], ["top_rows"], "rescore.rows",
           domain=MS_DOMAIN, bits=8, block_size=head.group, gather_axis=0, quantize_axis=1)  # (B, 1, k, D)
    g.node("Unsqueeze", ["hn", g.const("rescore.axis", np.array([2], np.int64))], ["hn4"], "rescore.unsqueeze")
    g.node("Mul", ["top_rows", "hn4"], ["top_prod"], "rescore.mul")
    g.node("ReduceSum", ["top_prod", g.const("rescore.last", np.array([-1], np.int64))], ["top_exact"], "rescore.sum",
           keepdims=0)
    g.node("ScatterElements", ["logits_candidates", "top_ids", "top_exact"], ["logits"], "rescore.scatter", axis=-1)


def build_decoder(weights: DecoderWeights, max_seq: int, accuracy_level: int | dict[str, int] = ACCURACY_INT8,
                  rescore_top: int = 0) -> Any:
    """The decoder graph (module docstring) as an onnx.ModelProto. max_seq: the rotary cache length (the
    KV-cache may not be longer). accuracy_level: MatMulNBits' (4: int8 activations, the fast CPU kernels;
    0: fp32), one for all or by projection kind / layer (`_Graph.level`). rescore_top: for an 8-bit head, pick
    candidates with a 4-bit copy of it and recompute their top k logits exactly (`_rescored_head`) instead."""
    from onnx import TensorProto, helper

    cfg = weights.config
    g = _Graph(accuracy_level)
    h, kv, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
    cos, sin = rope_cache(cfg, max_seq)
    g.const("rope.cos", cos)
    g.const("rope.sin", sin)
    _embedding(g, weights.embed, "input_ids", "h0")
    residual, x = "h0", "h0"
    eps = float(cfg.rms_norm_eps)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["B", "T"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 1, cfg.vocab_size])]
    for i, lw in enumerate(weights.layers):
        p = f"layers.{i}"
        if i == 0:
            g.node("SimplifiedLayerNormalization", [x, g.const(f"{p}.attn_norm", lw.attn_norm.astype(np.float32))],
                   [f"{p}.xn"], f"{p}.attn_norm", axis=-1, epsilon=eps, stash_type=1)
        elif x is None:  # the previous layer's down projection added the residual and normed already
            residual = f"{p}.res_in"
        else:
            attn_norm = g.const(f"{p}.attn_norm", lw.attn_norm.astype(np.float32))
            g.node("SkipSimplifiedLayerNormalization", [x, residual, attn_norm],
                   [f"{p}.xn", "", "", f"{p}.res_in"], f"{p}.attn_norm", domain=MS_DOMAIN, epsilon=eps)
            residual = f"{p}.res_in"
        bias = None if lw.qkv_bias is None else np.concatenate(lw.qkv_bias)
        fused = _concat([lw.q, lw.k, lw.v])
        if fused is not None:
            g.linear(f"{p}.qkv", f"{p}.xn", f"{p}.qkv_out", fused, bias)
        else:
            parts = [f"{p}.{n}_out" for n in "qkv"]
            biases = lw.qkv_bias or (None, None, None)
            for name, w, b, out in zip("qkv", (lw.q, lw.k, lw.v), biases, parts):
                g.linear(f"{p}.{name}", f"{p}.xn", out, w, b)
            g.node("Concat", parts, [f"{p}.qkv_out"], f"{p}.qkv_concat", axis=-1)
        past = [f"past_key_{i}", f"past_value_{i}"]
        present = [f"present_key_{i}", f"present_value_{i}"]
        for n in past:
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", kv, "S", hd]))
        for n in present:
            outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", kv, "S", hd]))
        g.attention(f"{p}.attn", f"{p}.qkv_out", past, present, h, kv, hd)
        mlp_norm = g.const(f"{p}.mlp_norm", lw.mlp_norm.astype(np.float32))
        if not (g.native_level(f"{p}.o", lw.o)
                and g._native_skip_norm(f"{p}.o", f"{p}.attn", lw.o, residual, mlp_norm, eps, f"{p}.mn",
                                        f"{p}.res_mid")):
            g.linear(f"{p}.o", f"{p}.attn", f"{p}.o_out", lw.o)
            g.node("SkipSimplifiedLayerNormalization", [f"{p}.o_out", residual, mlp_norm],
                   [f"{p}.mn", "", "", f"{p}.res_mid"], f"{p}.mlp_norm", domain=MS_DOMAIN, epsilon=eps)
        residual = f"{p}.res_mid"
        inter = cfg.intermediate_size
        gate_up = _concat([lw.gate, lw.up])
        if (g.native_level(f"{p}.gate_up", gate_up)
                and g._native_linear(f"{p}.gate_up", f"{p}.mn", f"{p}.act", gate_up, glu=True)):
            pass  # the activation is inside the node
        elif gate_up is not None:
            g.linear(f"{p}.gate_up", f"{p}.mn", f"{p}.gu", gate_up)
            g.node("Split", [f"{p}.gu", g.const(f"{p}.split", np.array([inter, inter], np.int64))],
                   [f"{p}.gate_out", f"{p}.up_out"], f"{p}.split", axis=-1)
        else:
            g.linear(f"{p}.gate", f"{p}.mn", f"{p}.gate_out", lw.gate)
            g.linear(f"{p}.up", f"{p}.mn", f"{p}.up_out", lw.up)
        if f"{p}.act" not in g.nodes[-1].output:
            g.node("Sigmoid", [f"{p}.gate_out"], [f"{p}.sig"], f"{p}.sigmoid")
            g.node("Mul", [f"{p}.gate_out", f"{p}.sig"], [f"{p}.silu"], f"{p}.silu")
            g.node("Mul", [f"{p}.silu", f"{p}.up_out"], [f"{p}.act"], f"{p}.act")
        x = f"{p}.down_out"
        nxt = f"layers.{i + 1}"
        if (i + 1 < len(weights.layers) and g.native_level(f"{p}.down", lw.down)
                and g._native_skip_norm(f"{p}.down", f"{p}.act", lw.down, residual,
                                        g.const(f"{nxt}.attn_norm", weights.layers[i + 1].attn_norm.astype(np.float32)),
                                        eps, f"{nxt}.xn", f"{nxt}.res_in")):
            x = None  # the next layer's norm is done
        else:
            g.linear(f"{p}.down", f"{p}.act", f"{p}.down_out", lw.down)
    # only each row's last position goes through the final norm and the head
    g.const("last.start", np.array([-1], np.int64))
    g.const("last.end", np.array([np.iinfo(np.int64).max], np.int64))
    g.const("last.axis", np.array([1], np.int64))
    g.node("Slice", [x, "last.start", "last.end", "last.axis"], ["x_last"], "x_last")
    g.node("Slice", [residual, "last.start", "last.end", "last.axis"], ["res_last"], "res_last")
    g.node("SkipSimplifiedLayerNormalization", ["x_last", "res_last", g.const("norm", weights.norm.astype(np.float32))],
           ["hn"], "final_norm", domain=MS_DOMAIN, epsilon=eps)
    head = weights.head if weights.head is not None else weights.embed
    if rescore_top and _gatherable(head):
        _rescored_head(g, head, weights.head is None, rescore_top)
    else:
        g.linear("lm_head", "hn", "logits", head)
    levels = (accuracy_level,) if isinstance(accuracy_level, int) else tuple(accuracy_level.values())
    native_asked = ACCURACY_NATIVE in levels
    if native_asked and not g.native_projections:  # (its session runs ONNX Runtime's own kernels on one thread)
        raise ValueError("no projection of this model fits orin-agent's native operator (it takes 4- and 8-bit weights "
                         "whose scales and minimums are half-precision values, K a multiple of 64); use split or fp32")
    graph = helper.make_graph(g.nodes, "decoder", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    if g.native:
        from kernels.ort_q4 import DOMAIN

        opsets.append(helper.make_opsetid(DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="orin-agent")
    model.ir_version = IR_VERSION
    return model


def weights_from_model(model: Any) -> DecoderWeights:
    """A torch Transformer's weights as numpy: nn.Linear as float arrays, QuantLinear / QuantEmbedding on
    their reference path (codes kept) as QuantWeight. A QuantLinear on a packed kernel (int4pack,
    int8pack) no longer holds its codes: build the model with reference=True for export."""
    import torch

    from kernels.weight_only import QuantLinear

    def lin(m: Any) -> Linear:
        if isinstance(m, torch.nn.Linear):
            return m.weight.detach().float().cpu().numpy().copy()
        if isinstance(m, QuantLinear) or hasattr(m, "group_size"):
            if getattr(m, "kernel", "reference") != "reference":
                raise ValueError(f"{m}: a QuantLinear on the {m.kernel} kernel keeps only packed codes; load the model "
                                 "with reference QuantLinear layers to export it")
            g_idx = getattr(m, "g_idx", None)
            k = m.weight.shape[1]
            if g_idx is not None and not bool(torch.equal(g_idx.long().cpu(), torch.arange(k) // m.group_size)):
                raise ValueError(f"{m}: act-order groups (g_idx) have no MatMulNBits form here")
            to = (lambda t: None if t is None else t.detach().cpu().numpy().copy())
            mins = getattr(m, "mins", None)
            codes = to(m.weight).astype(np.uint8)
            bits = getattr(m, "bits", 8 if int(codes.max(initial=0)) > 15 else 4)  # QuantEmbedding keeps no bits
            return QuantWeight(bits, codes, to(m.scales.float()),
                               None if mins is not None else to(m.zeros).astype(np.int32),
                               None if mins is None else to(mins.float()), m.group_size)
        raise ValueError(f"no ONNX form for a {type(m).__name__} projection")

    cfg = model.config
    layers = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        bias = None
        if a.q_proj.bias is not None:
            bias = tuple(p.bias.detach().float().cpu().numpy() for p in (a.q_proj, a.k_proj, a.v_proj))
        layers.append(LayerWeights(lin(a.q_proj), lin(a.k_proj), lin(a.v_proj), lin(a.o_proj), lin(mlp.gate_proj),
                                   lin(mlp.up_proj), lin(mlp.down_proj),
                                   layer.input_layernorm.weight.detach().float().cpu().numpy(),
                                   layer.post_attention_layernorm.weight.detach().float().cpu().numpy(), bias))
    emb = model.model.embed_tokens
    embed = lin(emb) if hasattr(emb, "group_size") else emb.weight.detach().float().cpu().numpy()
    tied = cfg.tie_word_embeddings
    head = None if tied else lin(model.lm_head)
    return DecoderWeights(cfg, embed, layers, model.model.norm.weight.detach().float().cpu().numpy(), head)


def weights_from_gguf(path: str | Path) -> DecoderWeights:
    """A GGUF file's weights as numpy, block-quantised tensors kept as codes (partition/gguf: names mapped,
    llama.cpp's Q/K rope permutation undone on the codes' rows, exactly)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize as gguf_dequantize

    from partition.gguf.quants import FLOAT, GROUP, KEPT, float_array, unpack
    from partition.gguf.reader import GGUFError, read_model
    from partition.gguf.tensors import hf_name, unpermute_rows

    g = read_model(path)
    cfg = g.config
    arrays: dict[str, Linear] = {}
    for t in g.reader.tensors:
        hf = hf_name(t.name)
        if hf is None:
            continue
        kind = QT(t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))
        rows = None
        if g.permuted_qk and ".self_attn.q_proj." in hf:
            rows = unpermute_rows(cfg.n_heads * cfg.head_dim, cfg.n_heads)
        elif g.permuted_qk and ".self_attn.k_proj." in hf:
            rows = unpermute_rows(cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads)
        if len(shape) == 2 and kind in KEPT:
            u = unpack(kind, t.data, *shape)
            arrays[hf] = as_quant(u.take_rows(rows) if rows is not None else u, GROUP)
        else:
            a = float_array(kind, t.data) if kind in FLOAT else gguf_dequantize(np.asarray(t.data), kind)
            a = np.asarray(a, np.float32).reshape(shape)
            arrays[hf] = a[rows] if rows is not None else a

    def get(name: str) -> Any:
        if name not in arrays:
            raise GGUFError(f"{g.path}: tensor {name} is missing from the file")
        return arrays[name]

    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        bias = None
        if cfg.qkv_bias:
            bias = tuple(np.asarray(get(f"{p}.self_attn.{n}_proj.bias"), np.float32) for n in "qkv")
        layers.append(LayerWeights(*(get(f"{p}.{n}.weight") for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")), get(f"{p}.input_layernorm.weight"),
            get(f"{p}.post_attention_layernorm.weight"), bias))
    head = None if cfg.tie_word_embeddings else get("lm_head.weight")
    return DecoderWeights(cfg, get("model.embed_tokens.weight"), layers, get("model.norm.weight"), head, str(path))
