"""ONNX Runtime's weight-only kernel, `com.microsoft::MatMulNBits`, fed from the project's canonical
quantised form (kernels/weight_only.py: codes q (N, K), scales s (N, G), and integer zero points z
(w = (q - z) * s) or float group minimums m (w = q * s + m), sequential groups of `block` columns).
numpy in, ONNX protos out: no torch here (the torch-free CPU decode path builds on it).

The operator (onnxruntime docs/ContribOperators.md, "com.microsoft.MatMulNBits"): Y = A @ dequant(B)^T
with B uint8 (N, K / block, block * bits / 8), codes packed low bits first along K; scales (N * K / block)
in A's type; optional zero points, either uint8 packed like B (4 bits: two per byte, low nibble first,
each row padded to whole bytes) or in A's type (float zero points); the default zero point is
2^(bits - 1). Attributes K, N, bits, block_size (a power of two >= 16), accuracy_level (0/1: fp32
compute; 4: A quantised to int8 per block, int8 dot products).

Float zero points (GGUF Q4_1's `d * q + m`, torch tinygemm's `zero`) are a slow path on the CPU in
onnxruntime 1.32: the kernel prepacks B only when the zero points are uint8
(contrib_ops/cpu/quantization/matmul_nbits.cc, PrePack returns early on `has_unquantized_zero_point_`)
and otherwise dequantises B on every call (0.3 GB/s here, scripts/bench_weight_only.py). So a
float-minimum weight goes through `offset_matmul_nodes`:
    x @ (s * q + m)^T = x @ (s * (q - 2^(bits-1)))^T + blocksum(x) @ (m + 2^(bits-1) * s)^T
the first term a MatMulNBits with the default zero point (the fast, prepacked path), the second a small
float MatMul on the per-block sums of x ((M, K / block) @ (K / block, N)): 1/block of the weight's FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MS_DOMAIN = "com.microsoft"
BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two >= 16 (the operator's schema)
ACCURACY_FP32, ACCURACY_INT8 = 0, 4  # accuracy_level values: fp32 compute; int8-quantised activations


@dataclass(frozen=True)
class NBitsWeight:
    """The MatMulNBits initialisers of one linear layer (numpy, ready for onnx.numpy_helper)."""

    b: np.ndarray  # uint8 (N, K / block, block * bits / 8)
    scales: np.ndarray  # float32 (N * K / block,)
    zero_points: np.ndarray | None  # uint8 packed, float32 (N * K / block,), or None (default 2^(bits-1))
    n: int
    k: int
    bits: int
    block: int


def _np(a: Any) -> np.ndarray:
    """numpy view of a numpy array or a CPU torch tensor (tests pass either)."""
    return a if isinstance(a, np.ndarray) else a.detach().cpu().numpy()


def pack_codes(q: Any, bits: int, block: int) -> np.ndarray:
    """Codes (N, K) in [0, 2^bits) -> B uint8 (N, K / block, block * bits / 8), low bits first."""
    c = _np(q)
    n, k = c.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    c = np.ascontiguousarray(c.astype(np.uint8)).reshape(n, k // block, block)
    if bits == 8:
        return c
    if bits == 4:
        return np.ascontiguousarray(c[..., 0::2] | (c[..., 1::2] << 4))
    raise ValueError(f"MatMulNBits packing here covers 4 and 8 bits, not {bits}")


def pack_zero_points(z: Any, bits: int) -> np.ndarray:
    """Integer zero points (N, G) -> uint8, 4 bits: two per byte (low nibble = even group), each row
    padded to whole bytes; 8 bits: one per byte. Flattened."""
    zz = np.ascontiguousarray(_np(z).astype(np.uint8))
    if bits == 8:
        return zz.reshape(-1)
    n, g = zz.shape
    if g % 2:
        zz = np.concatenate([zz, np.zeros((n, 1), np.uint8)], axis=1)
    return np.ascontiguousarray((zz[:, 0::2] | (zz[:, 1::2] << 4)).reshape(-1))


def nbits_weight(q: Any, scales: Any, zeros: Any | None, bits: int, block: int,
                 float_zeros: bool = False) -> NBitsWeight:
    """Canonical codes / scales / zero points -> MatMulNBits initialisers. zeros None: the operator's
    default (2^(bits-1), symmetric; also chosen when every integer zero point equals it). float_zeros:
    zeros are float (N, G) offsets in code units (the slow CPU path, see the module docstring)."""
    if block not in BLOCK_SIZES:
        raise ValueError(f"MatMulNBits block_size must be one of {BLOCK_SIZES}, not {block}")
    codes = _np(q)
    n, k = codes.shape
    s = np.ascontiguousarray(_np(scales), dtype=np.float32).reshape(-1)
    zp: np.ndarray | None
    if zeros is None:
        zp = None
    elif float_zeros:
        zp = np.ascontiguousarray(_np(zeros), dtype=np.float32).reshape(-1)
    elif bool((_np(zeros) == 2 ** (bits - 1)).all()):
        zp = None
    else:
        zp = pack_zero_points(zeros, bits)
    return NBitsWeight(pack_codes(codes, bits, block), s, zp, n, k, bits, block)


def split_offset(scales: Any, mins: Any, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """For w = s * q + m (per group, float m): the symmetric scales stay s and the residual float term is
    r = m + 2^(bits-1) * s, so w = s * (q - 2^(bits-1)) + r. Returns (s, r) float32 (N, G)."""
    s = np.asarray(_np(scales), dtype=np.float32)
    return s, (np.asarray(_np(mins), dtype=np.float32) + np.float32(2 ** (bits - 1)) * s).astype(np.float32)


def matmul_nbits_node(prefix: str, x: str, y: str, w: NBitsWeight, accuracy_level: int = ACCURACY_FP32,
                      bias: np.ndarray | None = None) -> tuple[list, list]:
    """One MatMulNBits node reading `x` (..., K) and writing `y` (..., N), and its initialisers named
    `prefix`.B / .scales / .zero_points / .bias. Returns (nodes, initialisers) as onnx protos."""
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(w.b, f"{prefix}.B"), numpy_helper.from_array(w.scales, f"{prefix}.scales")]
    inputs = [x, f"{prefix}.B", f"{prefix}.scales"]
    if w.zero_points is not None or bias is not None:
        if w.zero_points is not None:
            inits.append(numpy_helper.from_array(w.zero_points, f"{prefix}.zero_points"))
        inputs.append(f"{prefix}.zero_points" if w.zero_points is not None else "")
    if bias is not None:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(bias, np.float32), f"{prefix}.bias"))
        inputs += ["", f"{prefix}.bias"]  # g_idx (unused), bias
    node = helper.make_node("MatMulNBits", inputs, [y], name=prefix, domain=MS_DOMAIN, K=w.k, N=w.n,
                            bits=w.bits, block_size=w.block, accuracy_level=accuracy_level)
    return [node], inits


def offset_matmul_nodes(prefix: str, x: str, y: str, q: Any, scales: Any, mins: Any, bits: int, block: int,
                        rank: int = 3, accuracy_level: int = ACCURACY_FP32) -> tuple[list, list]:
    """y = x @ (s * q + m)^T for float per-group minimums m (GGUF Q4_1 / Q4_K), through the fast
    MatMulNBits path (`split_offset`): MatMulNBits with the default zero point plus
    ReduceSum(x over each block) @ r^T. x has `rank` 2 or 3 dims, the last K. Returns (nodes, initialisers)."""
    from onnx import helper, numpy_helper

    codes = _np(q)
    n, k = codes.shape
    g = k // block
    s, r = split_offset(scales, mins, bits)
    nodes, inits = matmul_nbits_node(prefix, x, f"{prefix}.main", nbits_weight(codes, s, None, bits, block),
                                     accuracy_level)
    lead = [0] * (rank - 1)  # Reshape's 0 = keep that dim
    inits += [numpy_helper.from_array(np.array(lead + [g, block], np.int64), f"{prefix}.blocks_shape"),
              numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}.last_axis"),
              numpy_helper.from_array(np.ascontiguousarray(r.T), f"{prefix}.offsetT")]  # (G, N)
    nodes += [helper.make_node("Reshape", [x, f"{prefix}.blocks_shape"], [f"{prefix}.xb"], name=f"{prefix}.reshape"),
              helper.make_node("ReduceSum", [f"{prefix}.xb", f"{prefix}.last_axis"], [f"{prefix}.xsum"],
                               name=f"{prefix}.blocksum", keepdims=0),
              helper.make_node("MatMul", [f"{prefix}.xsum", f"{prefix}.offsetT"], [f"{prefix}.off"],
                               name=f"{prefix}.offset_mm"),
              helper.make_node("Add", [f"{prefix}.main", f"{prefix}.off"], [y], name=f"{prefix}.add")]
    return nodes, inits


def reference_matmul(x: np.ndarray, w: NBitsWeight) -> np.ndarray:
    """What MatMulNBits computes, in float64 numpy (tests and checks): x (M, K) -> (M, N)."""
    b = w.b
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(w.n, -1) if w.bits == 4 else b.reshape(w.n, -1)
    g = w.k // w.block
    s = w.scales.astype(np.float64).reshape(w.n, g)
    if w.zero_points is None:
        z = np.full((w.n, g), 2.0 ** (w.bits - 1))
    elif w.zero_points.dtype == np.uint8:
        zb = w.zero_points
        z = (np.stack([zb & 0xF, zb >> 4], axis=-1).reshape(w.n, -1)[:, :g] if w.bits == 4
             else zb.reshape(w.n, g)).astype(np.float64)
    else:
        z = w.zero_points.astype(np.float64).reshape(w.n, g)
    grp = np.arange(w.k) // w.block
    wd = (codes.astype(np.float64) - z[:, grp]) * s[:, grp]
    return np.asarray(x, np.float64) @ wd.T
