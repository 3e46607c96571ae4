"""The block manager of a paged KV-cache: fixed-size blocks of `block_size` token slots, a free list,
and nothing else (no torch: the scheduler, which must load without torch, owns one). A sequence's
block table is the list of block ids it was given, in order; token position p of the sequence lives
in block table[p // block_size] at offset p % block_size. The storage the ids index is the runner's
(partition/runners/paged.py).

As vLLM's block manager (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023): memory is given out a block at a time as sequences grow, so a short
sequence never holds a max_seq-long row, and what is left when blocks run out is preemption.
"""
from __future__ import annotations

from typing import Iterable


class NoFreeBlocks(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of n_tokens cached tokens occupies."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)
