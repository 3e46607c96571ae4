"""`QuantEmbedding`: a token-embedding table kept as group-wise integer codes (the canonical weight-only
form of kernels/weight_only.py), dequantised only for the rows a batch looks up. A GGUF file's
Q8_0 / Q4 `token_embd` loads as one; when the embedding is tied to the output head, the head is a
`QuantLinear` over the same numbers and, on its reference path, the very same buffers.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.weight_only import QuantLinear


class QuantEmbedding(nn.Module):
    """ids (...,) -> rows (..., K) in `dtype`: w = (q - z) * s per group, or q * s + m with float mins."""

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                 dtype: torch.dtype = torch.float32, mins: Tensor | None = None) -> None:
        super().__init__()
        if (zeros is None) == (mins is None):
            raise ValueError("QuantEmbedding takes either integer zero points (zeros) or float group minimums (mins)")
        self.num_embeddings, self.embedding_dim = q.shape
        if self.embedding_dim % group_size or scales.shape[1] != self.embedding_dim // group_size:
            raise ValueError(f"{scales.shape[1]} groups of {group_size} do not tile rows of {self.embedding_dim}")
        self.group_size = group_size
        self.register_buffer("weight", q.to(torch.uint8).contiguous())
        self.register_buffer("scales", scales.to(dtype).contiguous())
        if mins is not None:
            self.register_buffer("mins", mins.to(dtype).contiguous())
        else:
            self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())

    @classmethod
    def sharing(cls, lin: QuantLinear) -> "QuantEmbedding":
        """The embedding tied to a reference-path QuantLinear head: its buffers, not a copy."""
        if lin.kernel != "reference":
            raise ValueError(f"a {lin.kernel} head keeps its codes packed for its kernel; build the embedding "
                             "from the codes instead")
        mins = getattr(lin, "mins", None)
        emb = cls.__new__(cls)
        nn.Module.__init__(emb)
        emb.num_embeddings, emb.embedding_dim, emb.group_size = lin.out_features, lin.in_features, lin.group_size
        emb.register_buffer("weight", lin.weight)
        emb.register_buffer("scales", lin.scales)
        emb.register_buffer("mins" if mins is not None else "zeros", mins if mins is not None else lin.zeros)
        return emb

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1).long()
        q = self.weight[flat].reshape(flat.shape[0], -1, self.group_size).to(self.scales.dtype)  # (T, G, gs)
        s = self.scales[flat][..., None]  # (T, G, 1)
        mins = getattr(self, "mins", None)
        rows = q * s + mins[flat][..., None] if mins is not None else (q - self.zeros[flat][..., None]) * s
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group={self.group_size}"
