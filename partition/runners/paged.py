"""Paged KV-cache for the PyTorch runner: each layer's K and V live in one pool of `num_blocks` fixed-
size blocks, (KV, num_blocks * block_size, hd), and a row's history is wherever its block table says
(kernels.paged: token position p is in block table[p // block_size] at offset p % block_size). Memory
is the pool, not max_batch x max_seq rows, so short sequences leave room for more of them.

`run(x, positions, slots, block_tables)`: the block tables come from the scheduler with each step
(agent.engine.paged_scheduler); `slots` are ignored. Attention reads the past through a gather of the
rows' slots into (B, KV, P, hd) (a copy, the plain-PyTorch reference of a paged-attention kernel), and
the new K/V are scattered into their blocks. Slots of a row beyond its history point at block 0 and
are masked by the slice (partition/model.py: slot k is attended iff k < positions[b, 0]).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from partition.model import SliceModule, Transformer
from partition.runners.base import ContextFull, SliceRunner
from partition.runners.torch_runner import slice_input
from partition.slices import SliceSpec


class PagedTorchRunner(SliceRunner):
    array_kind = "torch"

    def __init__(self, model: Transformer, spec: SliceSpec, max_seq: int, num_blocks: int, block_size: int = 16,
                 max_batch: int = 64) -> None:
        """max_seq: longest sequence (position bound); max_batch: most rows per step (no memory of its own)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        cfg = model.config
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.num_blocks, self.block_size = num_blocks, block_size
        self.module = SliceModule(model, spec.start, spec.end)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (cfg.n_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.pool = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * spec.n_layers)]

    @property
    def paging(self) -> tuple[int, int]:
        return self.num_blocks, self.block_size

    def _phys(self, tables: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pool slots of token positions pos (B, N) through the tables (B, max_blocks), int64 (B, N)."""
        return tables.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None,
            block_tables: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        positions = np.asarray(positions, dtype=np.int32)
        b, t = positions.shape
        if block_tables is None or len(block_tables) != b:
            raise ValueError("a paged runner needs one block table per row of the step")
        if positions.size and (int(positions.max()) >= self.max_seq or int(positions.min()) < 0):
            raise ContextFull(f"position {int(positions.max())} is outside the context of {self.max_seq} tokens")
        width = max(len(tb) for tb in block_tables)
        if any(-(-(int(positions[i, -1]) + 1) // self.block_size) > len(tb) for i, tb in enumerate(block_tables)):
            raise ValueError("a row's block table does not cover the positions it writes")
        tables = torch.tensor([list(tb) + [0] * (width - len(tb)) for tb in block_tables], dtype=torch.int64,
                              device=self.device)  # (B, max_blocks), padded with block 0 (masked)
        pos = torch.from_numpy(positions).to(self.device)
        x = slice_input(x, self.spec.is_first, self.device, self.dtype)
        past_len = int(positions[:, 0].max())
        span = torch.arange(past_len, device=self.device).expand(b, past_len)  # (B, P)
        history = torch.arange(past_len, device=self.device)[None] < pos[:, :1]  # slots a row really has
        read = torch.where(history, self._phys(tables, torch.where(history, span, 0)), 0).reshape(-1)  # (B * P,)
        past = [p[:, read].unflatten(1, (b, past_len)).transpose(0, 1) for p in self.pool]  # (B, KV, P, hd)
        out, *new = self.module(x, pos, *past)
        write = self._phys(tables, pos.long()).reshape(-1)  # (B * T,)
        for p, fresh in zip(self.pool, new):  # fresh (B, KV, T, hd)
            p[:, write] = fresh.transpose(0, 1).reshape(p.shape[0], b * t, p.shape[2])
        return out[:, -1] if self.spec.is_last else out
