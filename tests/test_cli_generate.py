"""`orin-agent generate` on the shipped model: greedy output is the same whatever the backend (torch,
ONNX Runtime) and the slicing (one slice or four), and bad input gives a one-line error, no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from partition.paths import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "model.safetensors").is_file(),
                                reason="the shipped model is not in this checkout")
PROMPT = "def parse(source, filename):"


@pytest.fixture()
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("HOME", str(tmp_path))  # ORT builds go to ~/.cache: keep them in the temp dir
    return CliRunner()


def _generate(runner: CliRunner, *args: str) -> dict:
    res = runner.invoke(app, ["generate", PROMPT, "--max-tokens", "64", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_greedy_identical_across_backends_and_slicings(runner: CliRunner) -> None:
    four = "0:2,2:4,4:6,6:8"
    runs = {(backend, slices): _generate(runner, "--backend", backend, *(["--slices", slices] if slices else []))
            for backend in ("torch", "ort") for slices in (None, four)}
    ref = runs[("torch", None)]
    assert ref["completion_tokens"] == 64 and ref["text"].strip()
    for key, out in runs.items():
        assert out["token_ids"] == ref["token_ids"], key
        assert out["text"] == ref["text"], key


@pytest.mark.parametrize("args, message", [
    (["--slices", "0:3,4:8"], "contiguous"),
    (["--backend", "tensorflow"], "backend"),
    (["--temperature", "-1"], "temperature"),
    (["--model", "/nonexistent/model"], "no such model folder"),
    (["--max-seq", "4"], "context holds 4"),
])
def test_bad_input_is_one_line_and_exit_2(runner: CliRunner, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["generate", PROMPT, *args])
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output


def test_kv_blocks_flag_pages_the_cache_with_the_same_output(runner: CliRunner) -> None:
    """--kv-blocks N: the paged cache (N blocks of 16 tokens; 6 = 96 slots for this prompt and 64 new
    tokens) gives the per-row cache's greedy tokens; with an INT8 cache it is a one-line error."""
    rows = _generate(runner)
    paged = _generate(runner, "--kv-blocks", "6")
    assert paged["kv_blocks"] == 6 and paged["token_ids"] == rows["token_ids"]
    res = runner.invoke(app, ["generate", PROMPT, "--max-tokens", "4", "--kv-blocks", "6", "--kv-cache", "int8"])
    assert res.exit_code != 0 and "kv_blocks" in res.output and "Traceback" not in res.output
