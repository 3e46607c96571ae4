"""`orin-agent generate --model smollm2-135m-instruct` (the alias and the .gguf path): `--chat` sends the prompt
through the model's chat template and stops at its end-of-turn token; plain generate stays a raw completion;
`--dtype` and bad model arguments."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from smollm2_helpers import GGUF, requires_smollm2

pytestmark = requires_smollm2
QUESTION = "What is the capital of France?"


@pytest.fixture()
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("HOME", str(tmp_path))  # the model folder goes to ~/.cache: keep it in the temp dir
    return CliRunner()


def _generate(runner: CliRunner, *args: str) -> dict:
    res = runner.invoke(app, ["generate", *args, "--json", "--temperature", "0"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_gguf_generate_chat_answers_through_the_template(runner: CliRunner) -> None:
    from agent.chat import chat_text
    from partition.tokenizer import Tokenizer

    chat = _generate(runner, QUESTION, "--model", "smollm2-135m-instruct", "--chat", "--backend", "torch", "-n", "24")
    assert "Paris" in chat["text"] and chat["finish_reason"] == "stop" and chat["completion_tokens"] < 24  # <|im_end|>
    tok = Tokenizer.from_dir("smollm2-135m-instruct")
    assert chat["prompt_tokens"] == len(tok.encode(chat_text(tok, QUESTION)))
    by_path = _generate(runner, QUESTION, "--model", str(GGUF), "--chat", "--backend", "torch", "-n", "24")
    assert by_path["token_ids"] == chat["token_ids"]
    raw = _generate(runner, QUESTION, "--model", str(GGUF), "--backend", "torch", "-n", "2")
    assert raw["prompt_tokens"] == len(tok.encode(QUESTION)) and not raw["chat"]


def test_gguf_generate_dtype_and_bad_arguments(runner: CliRunner) -> None:
    out = _generate(runner, "The capital of France is", "--model", "smollm2-135m-instruct", "--dtype", "bf16", "-n", "1")
    assert out["dtype"] == "bf16" and out["backend"] == "torch"  # auto: the one runner with a dtype choice
    for args, words in ((["--dtype", "fp8"], "--dtype must be one of fp32, fp16, bf16"),
                        (["--dtype", "bf16", "--backend", "ort"], "torch-backend setting"),
                        (["--model", "/nonexistent/model.gguf"], "no such file")):
        model = [] if "--model" in args else ["--model", "smollm2-135m-instruct"]
        res = runner.invoke(app, ["generate", "x", "-n", "1", *model, *args])
        assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output


def test_default_dtype_follows_the_runner_and_device(runner: CliRunner) -> None:
    """No --dtype: fp32 on the CPU (the ORT decoder here, and the torch runner); fp16 only for the torch runner on
    CUDA without exit heads (partition.config.default_dtype: the measured GPU default); the service's "auto" too."""
    from agent.config import ServiceConfig
    from agent.model_load import service_dtype
    from partition.config import default_dtype

    out = _generate(runner, "The capital of France is", "--model", "smollm2-135m-instruct", "-n", "1")
    assert out["dtype"] == "fp32" and out["backend"] == "ort"
    out = _generate(runner, "The capital of France is", "--model", "smollm2-135m-instruct", "--backend", "torch",
                    "-n", "1")
    assert out["dtype"] == "fp32"
    assert default_dtype("torch", "cuda") == "fp16" and default_dtype("torch", "cuda:1") == "fp16"
    assert default_dtype("torch", "cuda", exits=True) == "fp32"  # the exit heads run fp32
    assert default_dtype("ort", "cuda") == default_dtype("trt", "cuda") == default_dtype("torch", "cpu") == "fp32"
    cfg = ServiceConfig()
    assert cfg.dtype == "auto" and service_dtype(cfg) == "fp32"  # the shipped model on the CPU
    assert service_dtype(cfg.replace(dtype="bf16")) == "bf16"
