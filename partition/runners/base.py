"""The runner contract: one slice of layers, its own preallocated KV-cache, one call per step.

Every backend (PyTorch, ONNX Runtime, TensorRT) implements `SliceRunner`; a `Chain` of runners whose
layer ranges tile [0, n_layers) is the model. Arrays cross the seam as numpy or torch (each runner
says which with `array_kind`); the chain converts where two backends meet. Also the two cache helpers
every runner shares (`row_range`, `write_new_kv`) and the default cache length (`default_max_seq`). Slice geometry lives in partition.slices.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from partition.slices import SliceSpec
from partition.config import MAX_SEQ_CAP  # the default cache length cap (torch-free, beside the config)


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


def default_max_seq(max_position_embeddings: int) -> int:
    """The KV-cache length when none is asked for: the model's context, capped at MAX_SEQ_CAP (one rule
    for `load_chain` and for the TensorRT engines `orin-agent build` makes, so that their profiles match)."""
    return min(int(max_position_embeddings), MAX_SEQ_CAP)


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


def default_threads() -> int:
    """Threads for the CPU kernels when the caller names none: OMP_NUM_THREADS where it is set to a positive whole
    number (the variable torch's CPU kernels follow, so both runners honour one setting; at most the usable CPUs),
    else one per usable CPU. A value that is not a positive number is ignored, as torch ignores it."""
    cpus = usable_cpus()
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "").strip())
    except ValueError:
        return cpus
    return min(n, cpus) if n > 0 else cpus


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, so offline cores (a power budget takes some
    offline), taskset and container cpusets are left out; os.cpu_count() off Linux."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
