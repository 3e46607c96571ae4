"""A chain of slice runners is the model: token ids in, next-token logits out."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from partition.runners.base import SliceRunner
from partition.slices import check_tiling


def convert(x: Any, kind: str) -> Any:
    """Hand an array across a backend boundary (numpy <-> torch); a no-op when the kinds match."""
    if kind == "torch":
        return torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return x.detach().cpu().numpy() if torch.is_tensor(x) else x


class Chain:
    def __init__(self, runners: Sequence[SliceRunner]) -> None:
        if not runners:
            raise ValueError("a chain needs at least one slice runner")
        check_tiling([r.spec for r in runners], runners[0].spec.n_layers_total)
        self.runners = list(runners)
        self.max_seq = min(r.max_seq for r in runners)
        self.max_batch = min(r.max_batch for r in runners)

    def forward(self, tokens: np.ndarray, positions: np.ndarray,
                slots: Sequence[int] | None = None) -> np.ndarray:
        """tokens, positions: int32 (B, T). Returns float32 logits (B, V) of each row's last position."""
        x: Any = np.ascontiguousarray(tokens, dtype=np.int32)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        for r in self.runners:
            x = r.run(convert(x, r.array_kind), positions, slots)
        return np.asarray(convert(x, "numpy"), dtype=np.float32)
