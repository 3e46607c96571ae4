"""CUDA-graph decode for the PyTorch runner: one captured graph per (batch size, past length bucket)
replays a whole decode step of a slice (every layer, and the KV-cache write) with one launch.

Why: in decode (T == 1) each layer is a dozen small kernels, so an eager step is bound by Python and
kernel-launch overhead, not by memory traffic (measured on the H200: docs/BENCHMARKS.md, "PyTorch CUDA
runner (H200)"). A graph needs fixed shapes and addresses, which the runner's preallocated cache gives:
  - inputs are copied into static buffers (token ids or hidden states, positions) before each replay;
  - `past` is a fixed view `cache[:B, :, :L]` of each layer's buffer, never the filled prefix: the
    slice's mask attends slot k of row b iff k < positions[b, 0] (partition/model.py), so slots past
    a row's history are invisible and L can be any length >= the longest history;
  - the slice runs in in-place cache mode (partition/model.py): each layer writes its new K/V into
    the cache by position (index from the static positions buffer) and attends over the view with
    SDPA at the model dtype, so the graph never copies the history.
  - optionally the step is `torch.compile`d (inductor fuses the norms, RoPE and the weight-only
    dequantisation) before it is captured; that costs one compile per (batch, bucket).

Attention over L slots costs L, not the filled length, so L is bucketed: the smallest power of two
>= the longest history + 1 (the new slot; at least `min_bucket`), capped at max_seq. That bounds the waste to 2x the
history and costs one capture per bucket used (log2(max_seq) at most per batch size).

Only rows 0..B-1 are graphed (the cache views must be fixed); other slot sets and CPU stay eager, and the
eager runner remains the reference the graphs are tested against.

`PrefillGraphs` does the same for a fresh prompt (every row at positions 0..T-1): an eager prefill of an 8B
model is bound by the host too: 35-64 ms of host time (70-100 us a device op, ~500 of them) against 13.6 ms
(bf16) or 17.0 ms (INT4) of device work for 512 tokens on the H200's host (docs/BENCHMARKS.md, "INT4 prefill:
where the time goes"), and a Jetson's Cortex-A78AE cores queue no faster. Replayed, the same prefill took
14.1-14.7 ms (bf16) and 17.5-18.3 ms (INT4) in four leases. One graph per (B, T) seen twice: the first
prefill of a length runs eager, the second captures it, later ones replay (a prompt of a length never seen
again costs no capture); at most MAX_PREFILL_GRAPHS lengths are kept, the least recently used dropped.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from partition.model import SliceModule

MIN_BUCKET = 256  # shortest past length captured: below this the attention is noise next to the weights
WARMUP_STEPS = 2  # eager runs on a side stream before a capture (cuBLAS handles, allocator), per PyTorch's docs
PREFILL_WARMUP_STEPS = 1  # a prefill's length already ran eager once before its capture (handles, kernels loaded)
MAX_PREFILL_GRAPHS = 4  # prompt lengths kept captured (our choice: a benchmark's or a template's few lengths)


def past_buckets(max_seq: int, min_bucket: int = MIN_BUCKET) -> tuple[int, ...]:
    """Past lengths that may be captured: powers of two from min_bucket, then max_seq itself."""
    if max_seq < 1 or min_bucket < 1:
        raise ValueError(f"max_seq ({max_seq}) and min_bucket ({min_bucket}) must be positive")
    out: list[int] = []
    n = min_bucket
    while n < max_seq:
        out.append(n)
        n *= 2
    return (*out, max_seq)


def bucket_for(history: int, buckets: tuple[int, ...]) -> int:
    """The shortest bucket that holds `history` past slots (the last bucket is max_seq)."""
    for n in buckets:
        if history <= n:
            return n
    raise ValueError(f"history {history} exceeds the largest past length {buckets[-1]}")


def capture(step: Callable[[], Tensor], pool: Any, warmup: int = WARMUP_STEPS) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """step captured as a graph in `pool`, with its output tensor. Warm-up on a side stream first (PyTorch's
    CUDA-graph recipe): it runs the real step on the inputs already in the static buffers, and writing the same
    K/V at the same slots again is idempotent."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class DecodeGraphs:
    """Captured decode steps of one slice over one runner's cache; built lazily, one per (B, L)."""

    def __init__(self, module: SliceModule, cache: list[Tensor], max_batch: int, max_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, bucketed: bool = True,
                 min_bucket: int = MIN_BUCKET, compile_step: bool = False) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this slice is on {device}")
        self.module, self.cache = module, cache
        self.compile_step = compile_step
        self.is_first, self.is_last = module.is_first, module.is_last
        self.buckets = past_buckets(max_seq, min_bucket) if bucketed else (max_seq,)
        # Static inputs, allocated once: each graph reads the first B rows of them.
        self.x = (torch.zeros((max_batch, 1), dtype=torch.int32, device=device) if self.is_first
                  else torch.zeros((max_batch, 1, hidden_size), dtype=dtype, device=device))  # (Bmax, 1[, D])
        self.positions = torch.zeros((max_batch, 1), dtype=torch.int32, device=device)  # (Bmax, 1)
        # One memory pool for all graphs of this slice: safe because graphs never run concurrently and
        # each replay's output is cloned before another graph can reuse the pool's blocks.
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def _step(self, b: int, past_len: int) -> Callable[[], Tensor]:
        """One decode step of rows 0..b-1 reading only static buffers: the function that is captured."""
        past = [c[:b, :, :past_len] for c in self.cache]  # (b, KV, L, hd) views, fixed addresses
        module = self.module

        def step(x: Tensor, pos: Tensor) -> Tensor:
            out, *_ = module.run(x, pos, *past, cache_in_place=True)  # writes the new K/V into `past`
            return out[:, -1] if self.is_last else out

        # coordinate-descent tuning of inductor's reductions, as gpt-fast's generate.py sets it
        fn = (torch.compile(step, fullgraph=True, dynamic=False, options={"coordinate_descent_tuning": True})
              if self.compile_step else step)
        return lambda: fn(self.x[:b], self.positions[:b])

    def _capture(self, b: int, past_len: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        return capture(self._step(b, past_len), self.pool)

    def warm(self, b: int = 1) -> None:
        """Capture (and compile, with compile_step) the first bucket's graph for b rows now, at load, instead of
        inside the first decode step that needs it. The capture runs the step on the static inputs (token 0 at
        position 0): it writes K/V at slot 0 of rows 0..b-1, which the next prefill writes again, so call it
        before any row holds a history."""
        key = (b, self.buckets[0])
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)

    def run(self, x: Any, positions: np.ndarray) -> Tensor:
        """Decode rows 0..B-1: x (B, 1) ids or (B, 1, D) hidden states (numpy or torch, any device),
        positions int32 (B, 1) on the host (the bucket is picked there, with no device sync).
        Returns what the eager runner would: logits (B, V) or hidden states (B, 1, D)."""
        b = positions.shape[0]
        self.x[:b].copy_(torch.as_tensor(x))  # converts dtype and device as needed
        self.positions[:b].copy_(torch.from_numpy(positions))
        key = (b, bucket_for(int(positions[:, 0].max()) + 1, self.buckets))  # + 1: the new token's slot
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(*key)
        graph, out = entry
        graph.replay()
        return out.clone()  # the pool is shared between graphs: hand back a tensor no replay overwrites


class PrefillGraphs:
    """Captured prefills of fresh prompts of one slice over one runner's cache: one graph per (B, T) seen twice
    (module docstring). Shares the decode graphs' pool: no two graphs run at once and outputs are cloned."""

    def __init__(self, module: SliceModule, cache: list[Tensor], max_batch: int, max_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, pool: Any, limit: int = MAX_PREFILL_GRAPHS) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this slice is on {device}")
        self.module, self.cache, self.pool, self.limit = module, cache, pool, limit
        self.is_last = module.is_last
        self.x = (torch.zeros((max_batch, max_seq), dtype=torch.int32, device=device) if module.is_first
                  else torch.zeros((max_batch, max_seq, hidden_size), dtype=dtype, device=device))
        self.positions = torch.zeros((max_batch, max_seq), dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # in order of last use
        self.seen: set[tuple[int, int]] = set()

    @staticmethod
    def applies(positions: np.ndarray) -> bool:
        """A fresh prompt of more than one token: every row at positions 0..T-1."""
        return positions.shape[1] > 1 and bool((positions == np.arange(positions.shape[1])).all())

    def _step(self, b: int, t: int) -> Callable[[], Tensor]:
        past = [c[:b, :, :t] for c in self.cache]  # what the eager in-place prefill attends: slots 0..T-1
        x, pos, module = self.x[:b, :t], self.positions[:b, :t], self.module

        def step() -> Tensor:
            out, *_ = module.run(x, pos, *past, cache_in_place=True)
            return out[:, -1] if self.is_last else out

        return step

    def run(self, x: Any, positions: np.ndarray) -> Tensor | None:
        """The prefill replayed (captured first if this (B, T) was seen before), or None the first time a (B, T)
        comes: the caller runs that one eager. Returns what the eager runner would."""
        b, t = positions.shape
        key = (b, t)
        entry = self.graphs.pop(key, None)
        if entry is None and key not in self.seen:
            self.seen.add(key)
            return None
        self.x[:b, :t].copy_(torch.as_tensor(x))
        self.positions[:b, :t].copy_(torch.from_numpy(positions))
        if entry is None:
            if len(self.graphs) >= self.limit:
                del self.graphs[next(iter(self.graphs))]  # the least recently used
            entry = capture(self._step(b, t), self.pool, PREFILL_WARMUP_STEPS)
        self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out.clone()
