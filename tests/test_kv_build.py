"""The INT8-KV build as the product reaches it: `orin-agent build --kv-cache int8` exports Q/DQ slices
with scales calibrated on the model's validation text, the manifest and the build key record it (an
fp16 and an int8 build are never taken for each other), `load_chain(backend="ort", kv_cache="int8")`
runs them with greedy tokens equal to the torch INT8 path's on the first 64 tokens of two prompts, and
the mismatch and TensorRT refusals are one-line CLI errors.

Why 64 tokens and not "forever": the graph's scales are static per channel, the torch path's are
computed from the data per token and group, so the two caches round differently; on the shipped model
(2 slices, 10 prompts, 128 tokens) 9 prompts agreed on all 128 tokens and one diverged at token 18,
where the torch INT8 path also left the FP path (docs/BENCHMARKS.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from agent.cli import app
from partition.build import BuildError, cache_key, load_manifest, mismatch
from partition.build.export import ExportOptions
from partition.checkpoint import load_model, model_hash
from partition.config import load_config
from partition.paths import DEFAULT_MODEL_DIR
from partition.runners import BackendUnavailable, load_chain
from partition.runners.torch_runner import TorchRunner
from partition.slices import SliceSpec, parse_slices
from partition.tokenizer import Tokenizer
from tests.test_kv_qdq import greedy_ids

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "model.safetensors").is_file(),
                                reason="the shipped model is not in this checkout")
INT8 = ExportOptions(kv_cache="int8")


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    n = load_config(DEFAULT_MODEL_DIR).n_layers
    slices = f"0:2,2:{n}"
    out = tmp_path_factory.mktemp("int8build") / "b"
    res = CliRunner().invoke(app, ["build", "--out", str(out), "--slices", slices, "--kv-cache", "int8",
                                   "--check-trt", "10.3"])
    assert res.exit_code == 0, res.output
    assert "every slice passes" in res.output and "int8 KV-cache" in res.output
    return out, slices


def test_manifest_and_cache_key_carry_the_kv_cache(int8_build: tuple[Path, str]) -> None:
    out, slices = int8_build
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["kv_cache"] == "int8" and raw["export_options"]["kv_cache"] == "int8"
    cal = raw["kv_calibration"]
    assert "'val' split" in cal["data"] and cal["tokens"] == 4096 and len(cal["scales_sha256"]) == 16
    for s in raw["slices"]:
        kv = [t for t in (*s["inputs"], *s["outputs"]) if t["name"].startswith(("past_", "new_"))]
        assert kv and all(t["dtype"] == "int8" for t in kv)
        assert s["op_counts"]["QuantizeLinear"] == s["op_counts"]["DequantizeLinear"] == 2 * (s["end"] - s["start"])
        assert max(s["max_abs_diff"].values()) <= 1e-3  # logits / hidden states vs torch on the dequantised past
    manifest = load_manifest(out)
    assert manifest.options == INT8 and manifest.kv_calibration == cal
    specs = parse_slices(slices, load_config(DEFAULT_MODEL_DIR).n_layers)
    digest = model_hash(DEFAULT_MODEL_DIR)
    assert mismatch(manifest, out, digest, specs, INT8) is None
    why = mismatch(manifest, out, digest, specs, ExportOptions())
    assert why is not None and "KV-cache is int8, not fp16" in why and "--kv-cache fp16" in why
    assert cache_key(digest, specs, INT8) != cache_key(digest, specs, ExportOptions())
    assert ExportOptions().key() == "torchscript-op17-fold"  # fp16 keys (and caches) as before the option
    with pytest.raises(ValueError, match="kv cache"):
        ExportOptions(kv_cache="int4")


def test_ort_int8_greedy_equals_the_torch_int8_path(int8_build: tuple[Path, str]) -> None:
    out, slices = int8_build
    model = load_model(DEFAULT_MODEL_DIR)
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    n = model.config.n_layers
    for prompt in ("def parse(source, filename):", "class Queue:\n    def __init__(self"):
        ids = tok.encode(prompt)
        chain = load_chain(DEFAULT_MODEL_DIR, backend="ort", kv_cache="int8", build_dir=out, slices=slices,
                           max_seq=128)
        assert chain.runners[0].cache[0].dtype == np.int8
        q8 = TorchRunner(model, SliceSpec(0, n, n), 128, 1, kv_cache="int8")
        assert greedy_ids(chain.forward, ids, 64) == greedy_ids(q8.run, ids, 64), prompt


def test_fp16_request_on_an_int8_build_is_refused(int8_build: tuple[Path, str]) -> None:
    out, slices = int8_build
    with pytest.raises(BuildError, match="KV-cache is int8, not fp16"):
        load_chain(DEFAULT_MODEL_DIR, backend="ort", build_dir=out, slices=slices)
    res = CliRunner().invoke(app, ["build", "--out", str(out), "--slices", slices, "--check-trt", "10.3"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error:") and "orin-agent build --kv-cache fp16" in line


@pytest.mark.parametrize("args", [
    ["generate", "def f(", "--backend", "trt", "--kv-cache", "int8", "--device", "cuda"],
    ["build", "--out", "unused-dir", "--kv-cache", "int8", "--engine", "trt"],
])
def test_trt_with_int8_kv_is_a_one_line_error(args: list[str], tmp_path: Path) -> None:
    args = [str(tmp_path / a) if a == "unused-dir" else a for a in args]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.count("\n") == 1 and "not built yet" in res.output
    assert not (tmp_path / "unused-dir").exists()  # refused before any export
    with pytest.raises(BackendUnavailable, match="not built yet"):
        load_chain(DEFAULT_MODEL_DIR, backend="trt", kv_cache="int8", device="cuda")


def test_config_takes_int8_on_ort_only_where_it_runs() -> None:
    from agent.config import ConfigError, config_from_mapping

    assert config_from_mapping({"model": {"kv_cache": "int8", "backend": "ort"}}, "t.toml").kv_cache == "int8"
    with pytest.raises(ConfigError, match="not built yet"):
        config_from_mapping({"model": {"kv_cache": "int8", "backend": "trt"}}, "t.toml")
