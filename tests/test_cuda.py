"""CUDA backend of the PyTorch runner (run on the lent GPU machine; skipped without CUDA)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agent.engine.core import EngineCore
from agent.engine.executor import ChainExecutor
from agent.engine.types import Delta, Finished, SamplingParams
from partition.checkpoint import load_model
from partition.slices import even_slices
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
    core = EngineCore(ChainExecutor(_chain(tiny_checkpoint, "cuda", torch.float16)), tok)
    events = list(core.generate(tok.encode("def parse("), SamplingParams(max_tokens=32, ignore_eos=True)))
    text = "".join(e.text for e in events if isinstance(e, Delta))
    done = events[-1]
    assert isinstance(done, Finished) and done.usage.completion_tokens == 32 and text


# CUDA-graph decode (partition/runners/cuda_graphs.py) against the eager runner, the reference.

def _pair(model_dir: Path, dtype: torch.dtype, max_seq: int, max_batch: int = 1,
          buckets: bool = True) -> tuple[Chain, Chain]:
    """Eager and graphed two-slice chains over one CUDA model (weights shared, caches separate)."""
    model = load_model(model_dir, dtype=dtype, device="cuda")
    specs = even_slices(model.config.n_layers, 2)
    eager = Chain([TorchRunner(model, s, max_seq, max_batch) for s in specs])
    graphed = Chain([TorchRunner(model, s, max_seq, max_batch, cuda_graphs=True, graph_buckets=buckets)
                     for s in specs])
    return eager, graphed


def _captured(chain: Chain) -> set[tuple[int, int]]:
    return {key for r in chain.runners for key in r.graphs.graphs}


@pytest.mark.parametrize("buckets", [True, False])
def test_cuda_graphs_fp32_decode_matches_eager(tiny_checkpoint: Path, buckets: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, graphed = _pair(tiny_checkpoint, torch.float32, max_seq=600, buckets=buckets)
    prompt = 250  # decoding from 250 crosses the 256-slot bucket: two graphs when bucketed
    ids = np.random.default_rng(0).integers(1, 300, (1, prompt), dtype=np.int32)
    pos = np.arange(prompt, dtype=np.int32)[None]
    assert np.abs(eager.forward(ids, pos) - graphed.forward(ids, pos)).max() < 1e-4  # prefill: both eager
    for step in range(16):
        tok, p = np.array([[step + 3]], dtype=np.int32), np.array([[prompt + step]], dtype=np.int32)
        assert np.abs(eager.forward(tok, p) - graphed.forward(tok, p)).max() < 1e-4, step
    assert _captured(graphed) == ({(1, 256), (1, 512)} if buckets else {(1, 600)})


def test_cuda_graphs_fp32_batch_rows_and_fallback(tiny_checkpoint: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, graphed = _pair(tiny_checkpoint, torch.float32, max_seq=128, max_batch=2)
    for chain in (eager, graphed):  # rows with different histories: 10 and 20 tokens
        chain.forward(np.arange(1, 11, dtype=np.int32)[None], np.arange(10, dtype=np.int32)[None], [0])
        chain.forward(np.arange(5, 25, dtype=np.int32)[None], np.arange(20, dtype=np.int32)[None], [1])
    for step in range(8):  # rows 0..1 together: graphed, each row written at its own position
        tok = np.array([[step + 1], [step + 2]], dtype=np.int32)
        p = np.array([[10 + step], [20 + step]], dtype=np.int32)
        assert np.abs(eager.forward(tok, p) - graphed.forward(tok, p)).max() < 1e-4, step
    # Row 1 alone is not rows 0..B-1: eager fallback on the same cache, then graphs again.
    tok, p = np.array([[7]], dtype=np.int32), np.array([[28]], dtype=np.int32)
    assert np.abs(eager.forward(tok, p, [1]) - graphed.forward(tok, p, [1])).max() < 1e-4
    tok, p = np.array([[9], [8]], dtype=np.int32), np.array([[18], [29]], dtype=np.int32)
    assert np.abs(eager.forward(tok, p) - graphed.forward(tok, p)).max() < 1e-4
    assert _captured(graphed) == {(2, 128)}


def test_cuda_prefill_graphs_capture_a_length_seen_twice_and_match_eager(tiny_checkpoint: Path) -> None:
    """PrefillGraphs: a fresh prompt's first prefill of a length runs eager, the second captures, later ones replay,
    each with eager's logits and cache (the decode after it agrees); a chunk that continues a prompt stays eager;
    at most `limit` lengths are kept, the least recently used dropped."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(tiny_checkpoint, dtype=torch.float32, device="cuda")
    specs = even_slices(model.config.n_layers, 2)
    eager = Chain([TorchRunner(model, s, 128) for s in specs])
    graphed = Chain([TorchRunner(model, s, 128, cuda_graphs=True, prefill_graphs=True) for s in specs])
    rng = np.random.default_rng(1)

    def prefill(t: int, start: int = 0) -> None:
        ids = rng.integers(1, 300, (1, t), dtype=np.int32)
        pos = np.arange(start, start + t, dtype=np.int32)[None]
        assert np.abs(eager.forward(ids, pos) - graphed.forward(ids, pos)).max() < 1e-4, (t, start)

    def lengths() -> list[set]:
        return [set(r.prefill_graphs.graphs) for r in graphed.runners]

    prefill(20)
    assert lengths() == [set(), set()]  # first sight: eager
    prefill(20)
    prefill(20)
    assert lengths() == [{(1, 20)}, {(1, 20)}]  # both slices: token ids in the first, hidden states in the second
    for step in range(4):  # decoding on the cache the replayed prefill wrote
        tok, p = np.array([[step + 3]], dtype=np.int32), np.array([[20 + step]], dtype=np.int32)
        assert np.abs(eager.forward(tok, p) - graphed.forward(tok, p)).max() < 1e-4, step
    prefill(10, start=20)  # a continuation chunk: eager, nothing captured
    assert lengths() == [{(1, 20)}, {(1, 20)}]
    for r in graphed.runners:
        r.prefill_graphs.limit = 2
    for t in (5, 5, 6, 6, 20):
        prefill(t)
    assert lengths() == [{(1, 6), (1, 20)}] * 2  # 6 dropped the old 20; 20, seen before, captured again and dropped 5


def test_cuda_graphs_bf16_greedy_tokens_match_eager(tiny_checkpoint: Path) -> None:
    eager, graphed = _pair(tiny_checkpoint, torch.bfloat16, max_seq=256)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    runs = [list(EngineCore(ChainExecutor(chain), tok).generate(tok.encode("def parse("), params))[-1]
            for chain in (eager, graphed)]
    assert all(isinstance(d, Finished) for d in runs)
    assert runs[0].usage.completion_tokens == 64
    assert runs[1].token_ids == runs[0].token_ids
    assert _captured(graphed) == {(1, 256)}


def test_cuda_load_chain_warms_up_before_the_first_request(tiny_checkpoint: Path) -> None:
    """load_chain on CUDA captures the first decode graph at load (TorchRunner.warm_up), and the warm-up's writes
    into row 0's cache change nothing that a request then computes: the same logits as a chain never warmed."""
    from partition.runners import load_chain

    torch.backends.cuda.matmul.allow_tf32 = False
    warm = load_chain(tiny_checkpoint, backend="torch", device="cuda", max_seq=300, slices="0:2,2:4")
    assert _captured(warm) == {(1, 256)}  # before any request
    model = load_model(tiny_checkpoint, device="cuda")
    cold = Chain([TorchRunner(model, s, 300, cuda_graphs=True) for s in even_slices(model.config.n_layers, 2)])
    ids = np.arange(3, 23, dtype=np.int32)[None]
    pos = np.arange(20, dtype=np.int32)[None]
    assert np.abs(warm.forward(ids, pos) - cold.forward(ids, pos)).max() < 1e-4
    for step in range(6):
        tok, p = np.array([[step + 5]], dtype=np.int32), np.array([[20 + step]], dtype=np.int32)
        assert np.abs(warm.forward(tok, p) - cold.forward(tok, p)).max() < 1e-4, step
