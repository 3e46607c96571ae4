"""Exit heads for a model without a corpus record of its own: `--text FILE` (its paragraphs dealt into the
splits) or the model's own seeded generations, recorded beside the model and read back by the splits the
heads train, calibrate and evaluate on; train-exits then runs on such a model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture()
def bare(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, out)
    assert not (out / "corpus.json").exists()
    return out


def test_without_a_record_the_splits_say_what_to_do(bare: Path) -> None:
    from partition.exits.data import CorpusError, split_texts

    with pytest.raises(CorpusError, match="--text FILE"):
        split_texts(bare, "train")


def test_text_file_paragraphs_are_dealt_into_disjoint_splits(bare: Path, tmp_path: Path) -> None:
    from partition.exits.corpus import text_file_corpus
    from partition.exits.data import split_texts

    paragraphs = [f"paragraph number {i} about topic {i * 7 % 13}" for i in range(24)]
    (tmp_path / "t.txt").write_text("\n\n".join(paragraphs))
    text_file_corpus(bare, tmp_path / "t.txt")
    got = {s: set(split_texts(bare, s)) for s in ("train", "val", "test")}
    assert [len(got[s]) for s in ("train", "val", "test")] == [18, 3, 3]
    assert got["train"] | got["val"] | got["test"] == set(paragraphs)
    assert not (got["train"] & got["test"]) and not (got["val"] & got["test"])
    (tmp_path / "short.txt").write_text("one\n\ntwo")
    with pytest.raises(ValueError, match="need at least 8"):
        text_file_corpus(bare, tmp_path / "short.txt")


def test_generated_corpus_is_seeded_and_feeds_train_exits(bare: Path) -> None:
    from partition.exits.corpus import GENERATED_RECORD, PROMPTS, generated_corpus
    from partition.exits.data import split_texts
    from partition.exits.train import TrainOptions, train_exits

    generated_corpus(bare, new_tokens=24, seed=3, log=lambda m: None)
    first = json.loads((bare / GENERATED_RECORD).read_text())
    generated_corpus(bare, new_tokens=24, seed=3, log=lambda m: None)
    assert json.loads((bare / GENERATED_RECORD).read_text()) == first  # seeded: the same text again
    assert len(first["items"]) == len(PROMPTS)
    assert all(it["text"].startswith(it["prompt"]) and len(it["text"]) > len(it["prompt"]) for it in first["items"])
    assert len(split_texts(bare, "test")) == len(PROMPTS) // 8
    res = train_exits(bare, TrainOptions(layers=(1, 2), steps=2, batch=2, seq_len=16, lstsq_windows=4,
                                         eval_windows=4), progress=False)
    assert res.heads_path.is_file() and set(res.agreement) == {1, 2}


def test_quality_benchmarks_read_the_record_or_text_of_a_model_without_corpus_json(bare: Path, tmp_path: Path) -> None:
    """scripts/bench_kv.py and scripts/quant_quality.py on a model with no corpus.json (a GGUF file): the held-out
    text is --text FILE's, else the record's 'test' split; with neither, one line saying what to do."""
    from partition.exits.corpus import text_file_corpus
    from partition.exits.data import CorpusError, benchmark_texts
    from partition.tokenizer import Tokenizer
    from scripts.bench_kv import held_out_texts
    from scripts.quant_quality import held_out_ids

    with pytest.raises(CorpusError, match="pass --text FILE"):
        benchmark_texts(bare)
    with pytest.raises(SystemExit, match="pass --text FILE"):
        held_out_texts(bare)
    with pytest.raises(CorpusError, match="no such file"):
        benchmark_texts(bare, tmp_path / "missing.txt")
    (tmp_path / "held.txt").write_text("def f(x):\n    return x + 1\n")
    assert held_out_texts(bare, tmp_path / "held.txt") == ["def f(x):\n    return x + 1\n"]
    paragraphs = [f"paragraph {i}: the value is {i * 3}" for i in range(16)]
    (tmp_path / "t.txt").write_text("\n\n".join(paragraphs))
    text_file_corpus(bare, tmp_path / "t.txt")
    texts, source = benchmark_texts(bare)
    assert texts == [paragraphs[7], paragraphs[15]] and "corpus_text.json" in source  # the test split, in order
    tok = Tokenizer.from_dir(bare)
    ids = held_out_ids(bare, tok, 10 ** 6)
    assert ids == [t for p in texts for t in tok.encode(p) + [min(tok.eos_ids)]]
    assert held_out_ids(bare, tok, 5) == ids[:5]
