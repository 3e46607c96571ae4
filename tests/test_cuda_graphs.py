"""CUDA-graph decode, the parts that need no GPU: bucket choice and how the flag is refused on CPU.
(Graphed-vs-eager equality runs on a GPU: tests/test_cuda.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partition.checkpoint import load_model
from partition.runners import load_chain
from partition.slices import SliceSpec
from partition.runners.cuda_graphs import bucket_for, past_buckets
from partition.runners.torch_runner import TorchRunner


def test_past_buckets_are_powers_of_two_capped_at_max_seq() -> None:
    assert past_buckets(8192) == (256, 512, 1024, 2048, 4096, 8192)
    assert past_buckets(600) == (256, 512, 600)
    assert past_buckets(100) == (100,)
    assert past_buckets(600, min_bucket=64) == (64, 128, 256, 512, 600)
    with pytest.raises(ValueError):
        past_buckets(0)


def test_bucket_for_picks_the_shortest_that_holds_the_history() -> None:
    b = past_buckets(600)
    assert [bucket_for(n, b) for n in (0, 1, 256, 257, 512, 513, 600)] == [256, 256, 256, 512, 512, 600, 600]
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(601, b)


def test_torch_runner_refuses_cuda_graphs_on_cpu(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    n = model.config.n_layers
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        TorchRunner(model, SliceSpec(0, n, n), 64, cuda_graphs=True)
    assert TorchRunner(model, SliceSpec(0, n, n), 64).graphs is None  # off by default: eager


def test_load_chain_cuda_graphs_auto_is_off_on_cpu_and_explicit_is_refused(tiny_checkpoint: Path) -> None:
    chain = load_chain(tiny_checkpoint, max_seq=64)  # cuda_graphs=None: on only for a CUDA device
    assert all(r.graphs is None for r in chain.runners)
    with pytest.raises(ValueError, match="torch backend on a CUDA device"):
        load_chain(tiny_checkpoint, max_seq=64, cuda_graphs=True)
    with pytest.raises(ValueError, match="torch backend on a CUDA device"):
        load_chain(tiny_checkpoint, backend="ort", max_seq=64, device="cuda", cuda_graphs=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cli_generate_cuda_graphs_on_cpu_is_a_clear_error(tiny_checkpoint: Path) -> None:
    from typer.testing import CliRunner

    from agent.cli import app

    res = CliRunner().invoke(app, ["generate", "hi", "--model", str(tiny_checkpoint), "--cuda-graphs", "-n", "2"])
    assert res.exit_code == 2
    assert "CUDA graphs" in res.output
