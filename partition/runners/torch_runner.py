"""PyTorch runner (CPU or CUDA): a SliceModule plus a preallocated fixed-shape KV-cache written by
position, so no step ever reallocates or copies the whole cache.

Eager is the reference path. With `cuda_graphs=True` (CUDA only) decode steps of rows 0..B-1 replay a
captured graph instead (partition/runners/cuda_graphs.py); prefill and any other slot set stay eager,
and both paths read and write the same cache, so they can alternate freely."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from partition.model import SliceModule, Transformer
from partition.runners.base import SliceRunner, row_range, write_new_kv
from partition.slices import SliceSpec
from partition.runners.cuda_graphs import DecodeGraphs


class TorchRunner(SliceRunner):
    array_kind = "torch"

    def __init__(self, model: Transformer, spec: SliceSpec, max_seq: int, max_batch: int = 1,
                 cuda_graphs: bool = False, graph_buckets: bool = True) -> None:
        """cuda_graphs: replay captured graphs for decode (needs a CUDA model: refused on CPU rather
        than silently ignored, so a benchmark never reports eager numbers as graphed ones).
        graph_buckets: capture per power-of-two past length instead of over the whole max_seq buffer."""
        cfg = model.config
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.module = SliceModule(model, spec.start, spec.end)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (max_batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        # One K and one V buffer per layer, allocated once: (max_batch, KV, max_seq, hd).
        self.cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * spec.n_layers)]
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, but it is on {self.device}; "
                             "leave CUDA graphs off (the eager path is used) or load the model with device='cuda'")
        self.graphs = DecodeGraphs(self.module, self.cache, max_batch, max_seq, cfg.hidden_size, self.dtype,
                                   self.device, bucketed=graph_buckets) if cuda_graphs else None

    def _past(self, rows: list[int], past_len: int) -> list[torch.Tensor]:
        span = row_range(rows)
        if span is not None:  # consecutive rows: a view, no copy
            return [c[span, :, :past_len] for c in self.cache]
        idx = torch.tensor(rows, device=self.device)
        return [c[:, :, :past_len].index_select(0, idx) for c in self.cache]

    @torch.inference_mode()
    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> torch.Tensor:
        positions = np.asarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        b, t = positions.shape
        if self.graphs is not None and t == 1 and rows == list(range(b)):
            return self.graphs.run(x, positions)
        pos = torch.from_numpy(positions).to(self.device)
        if self.spec.is_first:
            x = torch.as_tensor(np.asarray(x, dtype=np.int32) if not torch.is_tensor(x) else x,
                                device=self.device).to(torch.int32)
        else:
            x = torch.as_tensor(x, device=self.device).to(self.dtype)
        past_len = int(positions[:, 0].max())  # rows with a shorter history mask the extra slots
        out, *new = self.module(x, pos, *self._past(rows, past_len))
        write_new_kv(self.cache, new, rows, positions)
        return out[:, -1] if self.spec.is_last else out
