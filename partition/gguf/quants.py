"""GGUF's block-quantised tensors unpacked into the project's group-wise weight-only form (the canonical
form of kernels/weight_only.py: integer codes, a scale per 32-element group, and an integer zero point
or a float group minimum), without dequantising to floats.

Block layouts (ggml's `ggml-common.h`; the gguf package's `gguf/quants.py` dequantises the same bytes,
and tests/test_gguf_quant.py checks each unpacking against it element for element):
  Q4_0  18 bytes / 32 weights: fp16 d, 16 bytes of nibbles (weight j low nibble of byte j, weight j+16 the
        high nibble); w = d * (q - 8)                       -> codes, scale d, zero 8
  Q4_1  20 bytes / 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m    -> codes, scale d, min m
  Q8_0  34 bytes / 32: fp16 d, 32 int8; w = d * q                            -> codes q + 128, scale d, zero 128
  Q4_K  144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
        128 bytes of nibbles (each 64 weights: 32 bytes, low nibbles the first sub-block, high the second);
        w = (d * sc) * q - (dmin * mn)                     -> codes, scale d * sc, min -(dmin * mn)
The products d * sc and dmin * mn are formed in float32, as ggml does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

GROUP = 32  # every type kept here has (sub-)blocks of 32 weights
KEPT = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q4_K: 4, QT.Q8_0: 8}  # block types loaded as codes, with their bits
FLOAT = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: None}  # loaded as they are (BF16: raw uint16)


@dataclass(frozen=True)
class Unpacked:
    """One quantised tensor in canonical form: codes (N, K) uint8, scales (N, K / 32) float32 and either
    zeros (N, K / 32) int32 (w = (q - z) * s) or mins (N, K / 32) float32 (w = q * s + m)."""

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None = None
    mins: np.ndarray | None = None

    def take_rows(self, rows: np.ndarray) -> "Unpacked":
        """The same tensor with its output rows reordered (the rope permutation acts on rows only, and
        every group lies inside one row, so permuting codes and group parameters alike is exact)."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[rows]))
        return Unpacked(self.bits, pick(self.codes), pick(self.scales), pick(self.zeros), pick(self.mins))

    def dequantize(self) -> np.ndarray:
        """float32 (N, K): for tests and for the float path (`--dequantize`)."""
        q = self.codes.astype(np.float32).reshape(*self.scales.shape, GROUP)
        s = self.scales[..., None]
        w = q * s + self.mins[..., None] if self.mins is not None else (q - self.zeros[..., None]) * s
        return w.reshape(self.codes.shape)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack(kind: QT, data: np.ndarray, n: int, k: int) -> Unpacked:
    """A tensor's raw bytes (N rows, as GGUFReader gives them) -> canonical form."""
    if k % GROUP:
        raise ValueError(f"a {kind.name} tensor's rows ({k}) are not a multiple of {GROUP}")
    raw = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if kind == QT.Q4_0:
        b = raw.reshape(n, k // 32, 18)
        g = k // 32
        return Unpacked(4, _nibbles(b[..., 2:]).reshape(n, k), _f16(b[..., 0:2]), np.full((n, g), 8, np.int32))
    if kind == QT.Q4_1:
        b = raw.reshape(n, k // 32, 20)
        return Unpacked(4, _nibbles(b[..., 4:]).reshape(n, k), _f16(b[..., 0:2]), mins=_f16(b[..., 2:4]))
    if kind == QT.Q8_0:
        b = raw.reshape(n, k // 32, 34)
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Unpacked(8, codes.reshape(n, k), _f16(b[..., 0:2]), np.full((n, k // 32), 128, np.int32))
    if kind == QT.Q4_K:
        if k % 256:
            raise ValueError(f"a Q4_K tensor's rows ({k}) are not a multiple of 256")
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (N, S)
        sc6 = b[..., 4:16].reshape(n, -1, 3, 4)  # 12 bytes: rows of 4
        lo, hi, mix = sc6[..., 0, :], sc6[..., 1, :], sc6[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # (N, S, 8)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 weights, 32 bytes each
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (N, S, 4, 2, 32): sub-block 2c, then 2c + 1
        scales = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
        mins = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
        return Unpacked(4, codes.reshape(n, k), scales, mins=mins)
    raise ValueError(f"{kind.name} blocks are not kept as codes (kept: {', '.join(t.name for t in KEPT)})")


def float_array(kind: QT, data: np.ndarray) -> np.ndarray:
    """An F32 / F16 / BF16 tensor's values as float32 numpy (BF16 widened bit-exactly)."""
    if kind == QT.BF16:
        return (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(data).view(FLOAT[kind]).astype(np.float32)
