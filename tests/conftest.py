"""Shared test set-up: skip `cuda`, `jetson` and `tensorrt` tests where the hardware or library is absent; start
the Triton interpreter checks of the selected tests in the background (tests/triton_interpreter.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _is_jetson() -> bool:
    model = Path("/proc/device-tree/model")
    return model.exists() and "Orin" in model.read_text(errors="replace")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {
        "cuda": None if _has_cuda() else "no CUDA GPU on this machine (run on the lent GPU machine)",
        "jetson": None if _is_jetson() else "not a Jetson Orin (run these tests on a board)",
        "tensorrt": None if importlib.util.find_spec("tensorrt") else
        "TensorRT's Python bindings are not installed (JetPack's python3-libnvinfer provides them)",
    }
    for item in items:
        for mark, reason in reasons.items():
            if reason and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session: pytest.Session) -> None:
    import triton_interpreter

    triton_interpreter.start(session.items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import triton_interpreter

    triton_interpreter.stop()


# The tiny tokenizer's training text: this file's own text as it was until 2026-12-06, kept apart since then so that
# editing conftest.py no longer changes the tokenizer (and with it every tiny-model test's tokens)
TINY_TEXT = (Path(__file__).resolve().parent / "data" / "tiny_bpe_corpus.txt").read_text() * 4 + (
    "héllo wörld — 世界 🎉 naïve café\n" * 20)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama with a real byte-level BPE tokenizer (trained here on a few KB of text):
    a complete checkpoint folder for tests that need no trained weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from partition.checkpoint import random_model, save_model
    from partition.config import ModelConfig

    out = tmp_path_factory.mktemp("tiny-checkpoint")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_TEXT], trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = ModelConfig("LlamaForCausalLM", tok.get_vocab_size(), 64, 4, 4, 2, 16, 128,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      eos_token_ids=(tok.token_to_id("<|endoftext|>"),))
    save_model(random_model(cfg, seed=7), out)
    return out
