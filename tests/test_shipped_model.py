"""The shipped small model (models/stdlib-llama-8l): it loads with the project's loader, keeps to its size
limits, its tokenizer gives held-out source back byte for byte, and it has learnt its corpus: held-out
perplexity far below what an untrained model (about the vocabulary size) or a unigram model reaches.

Held-out files are read from this machine's Python standard library and checked against the sha256
recorded in corpus.json; tests that need them skip (saying why) on a Python whose files differ.
"""
from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from partition.checkpoint import load_model
from partition.model import Transformer
from partition.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "stdlib-llama-8l"
# Two held-out (test-split) files of ordinary library code, neither seen by the model nor the tokenizer.
HELD_OUT = ("posixpath.py", "stat.py")
# Measured on the shipped weights: 28.4 on these 2 x 512-token windows (fp32, CPU). On the same windows
# an untrained model scores about 6300 and a unigram model of the train split about 1200; 60 leaves room
# for numerical noise across CPUs and torch versions while failing any model that has not learnt Python.
PPL_BOUND = 60.0
WINDOW = 512


@pytest.fixture(scope="module")
def model() -> Transformer:
    return load_model(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer(model: Transformer) -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR, model.config)


def _held_out_text(rel: str) -> str:
    corpus = json.loads((MODEL_DIR / "corpus.json").read_text(encoding="utf-8"))
    record = next(r for r in corpus["files"] if r["path"] == rel)
    assert record["split"] == "test", f"{rel} is not in the held-out split"
    path = Path(sysconfig.get_paths()["stdlib"]) / rel
    if not path.is_file():
        pytest.skip(f"{path} not found: this Python is not the {corpus['python_version']} of the corpus")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != record["sha256"]:
        pytest.skip(f"{path} differs from the recorded corpus file (Python {corpus['python_version']})")
    return raw.decode("utf-8")


def test_folder_loads_and_keeps_its_limits(model: Transformer) -> None:
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    folder_bytes = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.n_layers == 8
    assert cfg.n_kv_heads < cfg.n_heads  # grouped-query attention
    assert cfg.tie_word_embeddings
    assert 4096 <= cfg.vocab_size <= 8192
    assert 5_000_000 <= n_params <= 20_000_000 and n_params == cfg.n_params
    assert folder_bytes <= 25_000_000, f"{folder_bytes} bytes"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "corpus.json",
                 "README.md"):
        assert (MODEL_DIR / name).is_file(), name


def test_tokenizer_round_trips_held_out_source(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    assert tokenizer.eos_ids == {tokenizer.tk.token_to_id("<|endoftext|>")}
    for rel in HELD_OUT:
        text = _held_out_text(rel)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    odd = "\tx = 'é—✓'  \x0c\r\n# 🐍\n"  # tabs, form feed, CRLF, multi-byte characters: all bytes
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


@torch.no_grad()
def test_held_out_perplexity_is_far_below_an_untrained_model(model: Transformer,
                                                             tokenizer: Tokenizer) -> None:
    eos = tokenizer.tk.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for rel in HELD_OUT:
        ids += tokenizer.encode(_held_out_text(rel)) + [eos]
    x = torch.tensor(ids[:2 * WINDOW + 1]).unfold(0, WINDOW + 1, WINDOW)  # (2, WINDOW + 1)
    cfg = model.config
    past = [torch.zeros(x.shape[0], cfg.n_kv_heads, 0, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    pos = torch.arange(WINDOW, dtype=torch.int32).expand(x.shape[0], WINDOW)
    logits = model.slice(0, cfg.n_layers, all_logits=True)(x[:, :-1].int(), pos, *past)[0]
    ppl = math.exp(F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1)).item())
    assert ppl < PPL_BOUND, f"held-out perplexity {ppl:.1f}"
