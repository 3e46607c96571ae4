"""The runner contract: one slice of layers, its own preallocated KV-cache, one call per step.

Every backend (PyTorch, ONNX Runtime, TensorRT) implements `SliceRunner`; a `Chain` of runners whose
layer ranges tile [0, n_layers) is the model. Arrays cross the seam as numpy or torch (each runner
says which with `array_kind`); the chain converts where two backends meet.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class SliceSpec:
    """Layers [start, end) of a model with n_layers_total layers."""

    start: int
    end: int
    n_layers_total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.n_layers_total:
            raise ValueError(f"slice {self.start}:{self.end} is not a non-empty range inside 0:{self.n_layers_total}")

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.n_layers_total

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def parse_slices(text: str, n_layers: int) -> list[SliceSpec]:
    """'0:4,4:8' -> slices; they must be contiguous and cover every layer exactly once."""
    specs: list[SliceSpec] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            a, b = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"slice {part!r} is not of the form START:END (e.g. 0:4,4:8)") from None
        specs.append(SliceSpec(a, b, n_layers))
    check_tiling(specs, n_layers)
    return specs


def even_slices(n_layers: int, n_slices: int) -> list[SliceSpec]:
    if not 1 <= n_slices <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_slices} slices")
    cuts = [round(i * n_layers / n_slices) for i in range(n_slices + 1)]
    return [SliceSpec(a, b, n_layers) for a, b in zip(cuts, cuts[1:])]


def check_tiling(specs: Sequence[SliceSpec], n_layers: int) -> None:
    pos = 0
    for s in specs:
        if s.start != pos:
            raise ValueError(f"slices must be contiguous from layer 0: expected one starting at {pos}, got {s}")
        pos = s.end
    if pos != n_layers:
        raise ValueError(f"slices end at layer {pos} but the model has {n_layers} layers")


def row_range(rows: Sequence[int]) -> slice | None:
    """The cache rows as one slice when they are consecutive (a view of the cache), else None."""
    return slice(rows[0], rows[0] + len(rows)) if list(rows) == list(range(rows[0], rows[0] + len(rows))) else None


def write_new_kv(cache: Sequence[Any], new: Sequence[Any], rows: Sequence[int], positions: np.ndarray) -> None:
    """Write each layer's new K/V (B, KV, T, hd) into the cache rows at their positions: the only cache
    write of a step (numpy or torch arrays alike; T slots per row, never the whole cache)."""
    t = positions.shape[1]
    for i, row in enumerate(rows):
        start = int(positions[i, 0])
        for buf, fresh in zip(cache, new):
            buf[row, :, start:start + t] = fresh[i]


# KV-cache storage: "fp16" = unquantised in the model's dtype (fp16 on a GPU, fp32 on CPU), "int8" =
# group-wise INT8 with FP16 scales (kernels/kv_quant.py; torch backend).
KV_CACHE_KINDS = ("fp16", "int8")


class ContextFull(ValueError):
    """A step would write past the end of the preallocated KV-cache."""


class SliceRunner(ABC):
    """One slice on one backend, owning a KV-cache of shape (max_batch, n_kv_heads, max_seq, head_dim)
    per layer.

    `run(x, positions, slots)`: x is int32 token ids (B, T) for the first slice or hidden states
    (B, T, D); positions int32 (B, T), contiguous per row; slots are the cache rows of the B sequences
    (default 0..B-1). The runner attends to cache rows' slots < positions[b, 0], writes the T new K/V
    at their positions, and returns hidden states (B, T, D) or, for the last slice, the last
    position's logits (B, V) in float32.
    """

    spec: SliceSpec
    max_batch: int
    max_seq: int
    array_kind: str  # "numpy" or "torch"

    @abstractmethod
    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> Any:
        ...

    def check_room(self, positions: np.ndarray, slots: Sequence[int] | None) -> list[int]:
        b = positions.shape[0]
        rows = list(range(b)) if slots is None else list(slots)
        if len(rows) != b or any(not 0 <= r < self.max_batch for r in rows):
            raise ValueError(f"slots {rows} do not fit a batch of {b} in a cache of {self.max_batch} rows")
        if positions.size and (int(positions.max()) >= self.max_seq or int(positions.min()) < 0):
            raise ContextFull(f"position {int(positions.max())} is outside the KV-cache of {self.max_seq} tokens")
        return rows
