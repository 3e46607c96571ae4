"""The GPTQ and AWQ on-disk layouts of weight-only quantised checkpoints: packing the canonical codes
into their int32 words and back, reading a folder's `quantization_config`, and putting a module in
place of a linear layer. Shared by the offline quantiser (partition/quantize.py, which writes GPTQ)
and the run-time loader (partition/checkpoint.py, which reads GPTQ and AWQ). Canonical form: integer
codes q (N out, K in), scales and zeros (N, G), group index g_idx (K,), as kernels.weight_only takes them.

Layouts (safetensors, one set of tensors per quantised linear `P`, weight W of shape (N out, K in)):
  GPTQ (AutoGPTQ / transformers "gptq", checkpoint_format "gptq"): P.qweight int32 (K * bits / 32, N),
    codes packed along K, code j of a word at bits [j*bits, (j+1)*bits); P.qzeros int32
    (G, N * bits / 32) packed along N the same way, storing zero - 1 (the v1 format's offset;
    "gptq_v2" stores the zero itself); P.scales fp16 (G, N); P.g_idx int32 (K,) = group of column k.
  AWQ (AutoAWQ "awq", version "gemm", 4 bits): P.qweight int32 (K, N / 8) packed along N in the
    interleaved order 0, 2, 4, 6, 1, 3, 5, 7; P.qzeros int32 (G, N / 8) likewise (no offset);
    P.scales fp16 (G, N).
  weight = (code - zero) * scale. config.json carries `quantization_config` (quant_method, bits,
  group_size, sym, desc_act, checkpoint_format / version).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order of 8 INT4 codes in a word (awq/utils/packing_utils.py)


def _pack_rows(x: Tensor, bits: int) -> Tensor:
    """Pack codes (R, C) along dim 0 into int32 words (R * bits / 32, C), code j at bits j*bits."""
    per = 32 // bits
    r, c = x.shape
    if r % per:
        raise ValueError(f"{r} rows do not pack into 32-bit words of {per} codes")
    x = x.to(torch.int64).reshape(r // per, per, c)
    shifts = torch.arange(per, dtype=torch.int64, device=x.device)[None, :, None] * bits
    words = (x << shifts).sum(1)  # (R / per, C), < 2^32
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _unpack_rows(words: Tensor, bits: int) -> Tensor:
    """Inverse of _pack_rows: int32 (R', C) -> codes (R' * 32 / bits, C) int32."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=w.device)[None, :, None] * bits
    codes = (w[:, None, :] >> shifts) & (2 ** bits - 1)  # (R', per, C)
    return codes.reshape(-1, words.shape[1]).to(torch.int32)


def pack_gptq(q: Tensor, scales: Tensor, zeros: Tensor, bits: int, group_size: int) -> dict[str, Tensor]:
    """Canonical (N, K) codes, (N, G) scales and zeros -> the GPTQ v1 tensors of one linear layer."""
    n, k = q.shape
    gs = k if group_size == -1 else group_size
    return {"qweight": _pack_rows(q.T, bits),
            "qzeros": _pack_rows((zeros.to(torch.int64) - 1) & (2 ** bits - 1), bits).T.contiguous(),  # (G, N/per)
            "scales": scales.T.contiguous().half(),
            "g_idx": (torch.arange(k) // gs).to(torch.int32)}


def unpack_gptq(t: dict[str, Tensor], bits: int, v2: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GPTQ tensors -> codes (N, K), scales (N, G), zeros (N, G), g_idx (K,)."""
    q = _unpack_rows(t["qweight"], bits).T  # (N, K)
    zeros = _unpack_rows(t["qzeros"].T.contiguous(), bits)  # (N, G)
    if not v2:
        zeros = zeros + 1  # v1 stores zero - 1
    scales = t["scales"].T
    k = q.shape[1]
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[1])
    return q, scales, zeros, g_idx.to(torch.int32)


def pack_awq(q: Tensor, scales: Tensor, zeros: Tensor) -> dict[str, Tensor]:
    """Canonical INT4 -> AutoAWQ GEMM tensors (for tests and conversions)."""
    def pack_cols(x: Tensor) -> Tensor:  # (R, N) -> (R, N / 8), interleaved
        r, n = x.shape
        x = x.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)
        return _pack_rows(x.T, 4).T.contiguous()
    return {"qweight": pack_cols(q.T), "qzeros": pack_cols(zeros.T), "scales": scales.T.contiguous().half()}


def unpack_awq(t: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """AutoAWQ GEMM tensors -> codes (N, K), scales (N, G), zeros (N, G), g_idx (K,)."""
    inverse = [AWQ_ORDER.index(i) for i in range(8)]

    def unpack_cols(words: Tensor) -> Tensor:  # (R, N / 8) -> (R, N)
        x = _unpack_rows(words.T.contiguous(), 4).T  # (R, N), still interleaved
        r, n = x.shape
        return x.reshape(r, n // 8, 8)[:, :, inverse].reshape(r, n)
    q, zeros, scales = unpack_cols(t["qweight"]).T, unpack_cols(t["qzeros"]).T, t["scales"].T
    k = q.shape[1]
    return q, scales, zeros, (torch.arange(k) // (k // scales.shape[1])).to(torch.int32)


def quantization_config(model_dir: Path) -> dict | None:
    """config.json's quantization_config, or None for a floating-point checkpoint."""
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    qc = raw.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` (dotted, e.g. model.layers.0.mlp.up_proj) is."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)
