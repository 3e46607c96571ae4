"""The block manager of a paged KV-cache: fixed-size blocks of `block_size` token slots, a free list,
reference counts and a prefix cache (no torch: the scheduler, which must load without torch, owns one).
A sequence's block table is the list of block ids it holds, in order; token position p of the sequence
lives in block table[p // block_size] at offset p % block_size. The storage the ids index is the
runner's (partition/runners/paged.py).

As vLLM's block manager (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023): memory is given out a block at a time as sequences grow, so a short
sequence never holds a max_seq-long row, and what is left when blocks run out is preemption.

Prefix sharing: a *full* block whose tokens are known is registered under a hash of its tokens and of
the hash of the block before it (so equal hashes mean equal whole prefixes); another sequence starting
with the same tokens takes the same block (reference count + 1) instead of computing it again. Only full
blocks are shared and a sequence never writes into a full block, so a shared block is never written:
the first divergent (or partial) block is always the sequence's own, which is copy-on-write with
nothing to copy. A registered block whose count falls to 0 stays cached, evictable, least recently
used first, until its slot is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class NoFreeBlocks(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


def block_hash(prev: int | None, tokens: Sequence[int]) -> int:
    """The key of a full block: its tokens and the key of the block before it (None for the first)."""
    return hash((prev, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._ref: dict[int, int] = {}  # block -> sequences holding it (> 0)
        self._cached: dict[int, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never used, or cached but unreferenced (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return len(self._ref)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of n_tokens cached tokens occupies."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._ref:
                raise ValueError(f"KV block {b} is not allocated (double free?)")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                del self._ref[b]
                if b in self._hash_of:
                    self._evictable[b] = None  # most recently used last
                else:
                    self._free.append(b)

    # -- prefix cache --------------------------------------------------------------------------------
    def peek(self, h: int) -> int | None:
        return self._cached.get(h)

    def free_if_shared(self, hashes: Iterable[int]) -> int:
        """`num_free` after sharing the cached blocks of these hashes (an unreferenced one stops being free)."""
        return self.num_free - sum(self._cached[h] in self._evictable for h in hashes)

    def share(self, h: int) -> int:
        """Take a reference to the cached block of prefix hash h (which `peek` found)."""
        b = self._cached[h]
        if b in self._evictable:
            del self._evictable[b]
        self._ref[b] = self._ref.get(b, 0) + 1
        return b

    def register(self, block: int, h: int) -> None:
        """Block `block` (held, full, written) holds the prefix of hash h; the first block of a hash wins."""
        if h not in self._cached and block not in self._hash_of:
            self._cached[h] = block
            self._hash_of[block] = h
