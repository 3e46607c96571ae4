"""ONNX Runtime runner: the same logits as the torch runner over a prefill and 16 decode steps, for one
slice and for several, with either way of feeding the past K/V; batches with uneven histories;
provider selection; the load_chain seams."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partition.checkpoint import random_model, save_model
from partition.config import ModelConfig
from partition.runners import BackendUnavailable, Chain, load_chain
from partition.runners.base import ContextFull
from partition.slices import SliceSpec
from partition.runners.ort_runner import OrtOptions, OrtRunner, ProviderUnavailable, resolve_providers

CFG = ModelConfig("LlamaForCausalLM", 320, 64, 4, 4, 2, 16, 128, max_position_embeddings=64)
QWEN2 = ModelConfig("Qwen2ForCausalLM", 320, 64, 4, 4, 1, 16, 96, max_position_embeddings=64,
                    qkv_bias=True, tie_word_embeddings=True)
MAX_SEQ = 40


@pytest.fixture(scope="module", params=[CFG, QWEN2], ids=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    save_model(random_model(request.param, seed=5), d)
    return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("builds")


def _greedy(chain: Chain, prompt: np.ndarray, steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill the (1, T) prompt, then `steps` greedy decode steps; all logits and tokens."""
    t = prompt.shape[1]
    logits = [chain.forward(prompt, np.arange(t, dtype=np.int32)[None])]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps):
        logits.append(chain.forward(np.array([[tokens[-1]]], np.int32), np.array([[t + i]], np.int32)))
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("slices", [None, "0:1,1:3,3:4"], ids=["one-slice", "three-slices"])
@pytest.mark.parametrize("past_mode", ["prefix", "full"])
def test_ort_matches_torch_prefill_and_16_decode_steps(model_dir: Path, cache: Path, slices: str | None,
                                                       past_mode: str) -> None:
    prompt = np.random.default_rng(0).integers(0, 320, (1, 7), dtype=np.int32)
    ref_logits, ref_tokens = _greedy(load_chain(model_dir, "torch", max_seq=MAX_SEQ), prompt, 16)
    chain = load_chain(model_dir, "ort", slices, max_seq=MAX_SEQ, cache_dir=cache,
                       options=OrtOptions(past_mode=past_mode))
    logits, tokens = _greedy(chain, prompt, 16)
    assert tokens == ref_tokens
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-3, worst


def test_batch_with_uneven_histories_and_slots(model_dir: Path, cache: Path) -> None:
    """Two sequences in cache rows 2 and 0 at different lengths, decoded together, give the logits
    each gets alone."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 320, (1, 5), dtype=np.int32), rng.integers(0, 320, (1, 9), dtype=np.int32)
    chain = load_chain(model_dir, "ort", "0:2,2:4", max_seq=MAX_SEQ, max_batch=3, cache_dir=cache)
    la = chain.forward(a, np.arange(5, dtype=np.int32)[None], slots=[2])
    lb = chain.forward(b, np.arange(9, dtype=np.int32)[None], slots=[0])
    nxt = np.array([[la.argmax()], [lb.argmax()]], np.int32)
    both = chain.forward(nxt, np.array([[5], [9]], np.int32), slots=[2, 0])
    for prompt, row, n in ((a, 0, 5), (b, 1, 9)):
        alone = load_chain(model_dir, "torch", max_seq=MAX_SEQ)
        alone.forward(prompt, np.arange(n, dtype=np.int32)[None])
        want = alone.forward(nxt[row:row + 1], np.array([[n]], np.int32))
        assert np.abs(both[row] - want[0]).max() <= 1e-3


def test_context_full_and_wrong_file(model_dir: Path, cache: Path) -> None:
    chain = load_chain(model_dir, "ort", max_seq=8, cache_dir=cache)
    with pytest.raises(ContextFull):
        chain.forward(np.zeros((1, 3), np.int32), np.array([[6, 7, 8]], np.int32))
    onnx_file = chain.runners[0].path
    with pytest.raises(ValueError, match="do not match slice"):
        OrtRunner(onnx_file, SliceSpec(0, 2, 4), max_seq=8)


def test_providers() -> None:
    assert resolve_providers(None) == ["CPUExecutionProvider"]
    assert resolve_providers(["cpu"]) == ["CPUExecutionProvider"]
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ProviderUnavailable, match="available: .*CPUExecutionProvider"):
            resolve_providers(["cuda"])


def test_backend_seams(model_dir: Path) -> None:
    with pytest.raises(BackendUnavailable, match="TensorRT"):
        load_chain(model_dir, "trt")
    with pytest.raises(ValueError, match="backend"):
        load_chain(model_dir, "tflite")
    with pytest.raises(ValueError, match="START:END"):
        load_chain(model_dir, "torch", slices="0-4")


def test_threads_follow_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no thread count given, ONNX Runtime's pool takes OMP_NUM_THREADS (the variable torch's CPU kernels
    follow, and what scripts/bench_peer.py and the peer check set for "the same threads" as llama.cpp), capped
    at the CPUs this process may use; unset or not a positive number: one thread per usable CPU. A count given
    in OrtOptions wins."""
    from partition.runners.base import default_threads, usable_cpus
    from partition.runners.ort_runner import session_options

    cpus = usable_cpus()
    for value, want in (("1", 1), (str(cpus + 7), cpus), ("0", cpus), ("two", cpus), ("", cpus)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert default_threads() == want, value
        assert session_options(OrtOptions()).intra_op_num_threads == want, value
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert session_options(OrtOptions(threads=2)).intra_op_num_threads == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == cpus
