"""PyTorch runner (CPU or CUDA): a SliceModule plus a preallocated fixed-shape KV-cache written by
position, so no step ever reallocates or copies the whole cache."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from partition.model import SliceModule, Transformer
from partition.runners.base import SliceRunner, SliceSpec


class TorchRunner(SliceRunner):
    array_kind = "torch"

    def __init__(self, model: Transformer, spec: SliceSpec, max_seq: int, max_batch: int = 1) -> None:
        cfg = model.config
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.module = SliceModule(model, spec.start, spec.end)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (max_batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        # One K and one V buffer per layer, allocated once: (max_batch, KV, max_seq, hd).
        self.cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * spec.n_layers)]

    def _past(self, rows: list[int], past_len: int) -> list[torch.Tensor]:
        if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous rows: a view, no copy
            return [c[rows[0]:rows[0] + len(rows), :, :past_len] for c in self.cache]
        idx = torch.tensor(rows, device=self.device)
        return [c[:, :, :past_len].index_select(0, idx) for c in self.cache]

    @torch.inference_mode()
    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> torch.Tensor:
        positions = np.asarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        pos = torch.from_numpy(positions).to(self.device)
        if self.spec.is_first:
            x = torch.as_tensor(np.asarray(x, dtype=np.int32) if not torch.is_tensor(x) else x,
                                device=self.device).to(torch.int32)
        else:
            x = torch.as_tensor(x, device=self.device).to(self.dtype)
        past_len = int(positions[:, 0].max())  # rows with a shorter history mask the extra slots
        out, *new = self.module(x, pos, *self._past(rows, past_len))
        t = positions.shape[1]
        for b, row in enumerate(rows):
            start = int(positions[b, 0])
            for cache, fresh in zip(self.cache, new):
                cache[row, :, start:start + t] = fresh[b]
        return out[:, -1] if self.spec.is_last else out
