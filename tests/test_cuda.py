"""CUDA backend of the PyTorch runner (run on the lent GPU machine; skipped without CUDA)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agent.generation import Generation, SamplingParams
from partition.checkpoint import load_model
from partition.runners.base import even_slices
from partition.runners.chain import Chain
from partition.runners.torch_runner import TorchRunner
from partition.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda


def _chain(model_dir: Path, device: str, dtype: torch.dtype, n_slices: int = 2) -> Chain:
    model = load_model(model_dir, dtype=dtype, device=device)
    return Chain([TorchRunner(model, s, 128) for s in even_slices(model.config.n_layers, n_slices)])


def test_cuda_fp32_matches_cpu(tiny_checkpoint: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = _chain(tiny_checkpoint, "cpu", torch.float32), _chain(tiny_checkpoint, "cuda", torch.float32)
    ids = np.arange(1, 20, dtype=np.int32)[None]
    pos = np.arange(19, dtype=np.int32)[None]
    assert np.abs(cpu.forward(ids, pos) - gpu.forward(ids, pos)).max() < 1e-4
    for step in range(8):
        tok, p = np.array([[step + 3]], dtype=np.int32), np.array([[19 + step]], dtype=np.int32)
        assert np.abs(cpu.forward(tok, p) - gpu.forward(tok, p)).max() < 1e-4


def test_cuda_fp16_greedy_generation_runs(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    g = Generation(_chain(tiny_checkpoint, "cuda", torch.float16), tok, "def parse(",
                   SamplingParams(max_tokens=32, ignore_eos=True))
    text = "".join(g.stream())
    assert g.stats.completion_tokens == 32 and text
