"""`--precision auto` on CPU: the round-to-nearest layer quantiser changes exactly one layer and puts it
back, the chosen plan is written and its measured increase stays within the budget, the calibration
text is only held-out files whose sha256 matches, and `orin-agent build --precision auto` writes the plan
and reports the increase and bytes vs FP16 (a tiny random model with the shipped tokenizer)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from agent.cli import app
from partition.checkpoint import random_model, save_model
from partition.config import ModelConfig
from partition.paths import DEFAULT_MODEL_DIR
from partition.trt.autoquant import (PLAN_FILE, auto_precision, held_out_text, parse_budget,
                                     rtn_layer_quantizer, write_plan)

VOCAB = 6144  # the shipped tokenizer's
CFG = ModelConfig("LlamaForCausalLM", VOCAB, 128, 2, 4, 2, 32, 256, max_position_embeddings=256)
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 250


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("auto")
    model_dir, stdlib = root / "model", root / "stdlib"
    save_model(random_model(CFG, seed=3), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, model_dir / name)
    stdlib.mkdir()
    (stdlib / "held.py").write_text(TEXT)
    (stdlib / "stale.py").write_text("print('changed since the corpus was recorded')\n" * 50)
    files = [{"path": "stale.py", "sha256": "0" * 64, "split": "test"},
             {"path": "train.py", "sha256": "1" * 64, "split": "train"},
             {"path": "held.py", "sha256": hashlib.sha256(TEXT.encode()).hexdigest(), "split": "test"}]
    (model_dir / "corpus.json").write_text(json.dumps({"stdlib_dir": str(stdlib), "files": files}))
    return model_dir


def test_quantizer_changes_one_layer_and_restores_it() -> None:
    model = random_model(CFG, seed=1)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with rtn_layer_quantizer(model.model.layers[1], "int4-wo"):
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert changed and all(n.startswith("model.layers.1.") and "norm" not in n for n in changed)
        w = dict(model.named_parameters())[changed[0]]
        # INT4 groups of 128: at most 16 distinct values per row and group
        assert w[0, :128].unique().numel() <= 16 < before[changed[0]][0, :128].unique().numel()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_held_out_text_skips_files_whose_hash_differs(tiny: Path) -> None:
    assert held_out_text(tiny, 500) == TEXT[:500]
    with pytest.raises(FileNotFoundError, match="sha256"):
        held_out_text(tiny, 10 * len(TEXT))


@pytest.mark.parametrize("budget", [0.0, 0.01])
def test_plan_written_and_within_budget(tiny: Path, tmp_path: Path, budget: float) -> None:
    ids = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(0))
    res = auto_precision(tiny, budget, ids=ids)
    assert res.predicted_increase <= budget + 1e-12
    assert res.measured_increase <= budget + 0.005  # first-order prediction; the whole plan measured for real
    assert set(res.plan) == {"0", "1"} and res.weight_bytes <= res.fp16_bytes
    saved = json.loads(write_plan(res, tmp_path).read_text())
    assert saved["plan"] == res.plan and saved["bytes_ratio"] == res.weight_bytes / res.fp16_bytes


def test_parse_budget() -> None:
    assert parse_budget("1%") == pytest.approx(0.01) and parse_budget("0.02") == 0.02
    with pytest.raises(ValueError, match="percentage"):
        parse_budget("lots")


def test_cli_build_precision_auto(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["build", "--model", str(tiny), "--out", str(out), "--no-verify",
                                   "--precision", "auto", "--max-ppl-increase", "2%", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["precision_plan"]
    assert plan["budget"] == pytest.approx(0.02) and plan["predicted_ppl_increase"] <= 0.02
    assert 0 < plan["bytes_vs_fp16"] <= 1 and plan["fp16_bytes"] > 0
    assert json.loads((out / PLAN_FILE).read_text())["plan"] == plan["plan"]
    text = CliRunner().invoke(app, ["build", "--model", str(tiny), "--out", str(out), "--no-verify",
                                    "--precision", "auto"])
    assert text.exit_code == 0 and "measured" in text.output and "fp16" in text.output


def test_cli_auto_engine_refused_before_work(tiny: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["build", "--model", str(tiny), "--out", str(tmp_path / "o"),
                                   "--precision", "auto", "--engine", "trt"])
    assert res.exit_code == 2 and "Q/DQ" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()
