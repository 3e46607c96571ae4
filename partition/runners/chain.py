"""A chain of slice runners is the model: token ids in, next-token logits out."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from partition.runners.base import SliceRunner
from partition.slices import check_tiling


def convert(x: Any, kind: str) -> Any:
    """Hand an array across a backend boundary (numpy <-> torch); a no-op when the kinds match. torch is
    imported only when a tensor is made (a chain of numpy runners never loads it: ~220 MB of RSS)."""
    if kind == "torch":
        if isinstance(x, np.ndarray):
            import torch

            return torch.from_numpy(x)
        return x
    return x if isinstance(x, np.ndarray) or not hasattr(x, "detach") else x.detach().cpu().numpy()


class Chain:
    def __init__(self, runners: Sequence[SliceRunner]) -> None:
        if not runners:
            raise ValueError("a chain needs at least one slice runner")
        check_tiling([r.spec for r in runners], runners[0].spec.n_layers_total)
        self.runners = list(runners)
        self.max_seq = min(r.max_seq for r in runners)
        self.max_batch = min(r.max_batch for r in runners)
        pagings = {getattr(r, "paging", None) for r in runners}
        if len(pagings) != 1:
            raise ValueError("the slices of a chain must all be paged alike (or none paged)")
        self.paging: tuple[int, int] | None = pagings.pop()  # (num_blocks, block_size) of a paged KV-cache

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: Sequence[int] | None = None,
                block_tables: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """tokens, positions: int32 (B, T). Returns float32 logits (B, V) of each row's last position.
        block_tables: each row's KV blocks, for a paged chain (then `slots` are ignored)."""
        x: Any = np.ascontiguousarray(tokens, dtype=np.int32)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        if (block_tables is None) != (self.paging is None):
            raise ValueError("a paged chain needs block tables, and an unpaged one takes none")
        for r in self.runners:
            x = (r.run(convert(x, r.array_kind), positions, slots) if block_tables is None
                 else r.run(convert(x, r.array_kind), positions, slots, block_tables=block_tables))
        return np.asarray(convert(x, "numpy"), dtype=np.float32)
