"""Slice export: ONNX files that pass onnx.checker and our TensorRT-compatibility check, agree with the
torch slice, and come with a truthful manifest; the checker itself catches what it claims to; the
build cache and `orin-agent build`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import typer
from onnx import TensorProto, helper
from typer.testing import CliRunner

from partition.build import export as export_mod
from partition.build import BuildError, build_slices, ensure_build, load_manifest
from partition.checkpoint import model_hash, random_model, save_model
from partition.config import ModelConfig
from partition.build.export import ExportOptions, compare_with_torch, export_slice, sha256_file
from partition.build.trt_check import OnnxCompatError, assert_trt_compat, check_onnx_file, check_trt_compat
from partition.slices import SliceSpec

LLAMA = ModelConfig("LlamaForCausalLM", 256, 64, 4, 4, 2, 16, 128, max_position_embeddings=256)
# Qwen2: QKV bias, tied embeddings, one KV head for four query heads.
QWEN2 = ModelConfig("Qwen2ForCausalLM", 256, 64, 4, 4, 1, 16, 96, rope_theta=1e6, rms_norm_eps=1e-6,
                    max_position_embeddings=256, qkv_bias=True, tie_word_embeddings=True)
SLICES = "0:1,1:3,3:4"


@pytest.fixture(scope="module", params=[LLAMA, QWEN2], ids=["llama", "qwen2"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param.architecture)
    save_model(random_model(request.param, seed=3), root / "model")
    build_slices(root / "model", SLICES, root / "build")
    return root / "model", root / "build"


def test_each_slice_checks_and_matches_torch(built: tuple[Path, Path]) -> None:
    model_dir, build_dir = built
    manifest = load_manifest(build_dir)
    assert [str(s.spec) for s in manifest.slices] == SLICES.split(",")
    for s in manifest.slices:
        path = build_dir / s.file
        report = check_onnx_file(path)  # onnx.checker full_check + our TensorRT rules
        assert report.ok and "If" not in report.op_counts and "Attention" not in report.op_counts
        assert set(s.max_abs_diff) == {"prefill", "decode"}
        assert max(s.max_abs_diff.values()) <= 1e-3
        model = onnx.load(str(path))
        assert [i.version for i in model.opset_import if i.domain in ("", "ai.onnx")] == [17]
        for init in model.graph.initializer:  # no -inf / NaN anywhere in the weights or masks
            assert np.isfinite(onnx.numpy_helper.to_array(init).astype(np.float64)).all(), init.name


def test_manifest_records_the_build(built: tuple[Path, Path]) -> None:
    model_dir, build_dir = built
    raw = json.loads((build_dir / "manifest.json").read_text())
    assert raw["model_hash"] == model_hash(model_dir)
    assert raw["opset"] == 17 and raw["exporter"] == "torchscript"
    assert raw["config"]["n_layers"] == 4
    assert set(raw["versions"]) == {"torch", "onnx", "onnxruntime", "onnxscript", "graph_code"}
    first, middle, last = raw["slices"]
    assert (first["start"], first["end"], last["start"], last["end"]) == (0, 1, 3, 4)
    assert first["inputs"][0] == {"name": "input_ids", "dtype": "int32", "shape": ["B", "T"]}
    assert first["inputs"][1] == {"name": "positions", "dtype": "int32", "shape": ["B", "T"]}
    assert middle["inputs"][0] == {"name": "hidden_states", "dtype": "float32", "shape": ["B", "T", 64]}
    kv = raw["config"]["n_kv_heads"]
    assert [t["name"] for t in middle["inputs"][2:]] == ["past_key_1", "past_value_1", "past_key_2", "past_value_2"]
    assert middle["inputs"][2]["shape"] == ["B", kv, "P", 16]
    assert middle["outputs"][0] == {"name": "hidden_states_out", "dtype": "float32", "shape": ["B", "T", 64]}
    assert middle["outputs"][1] == {"name": "new_key_1", "dtype": "float32", "shape": ["B", kv, "T", 16]}
    assert last["outputs"][0] == {"name": "logits", "dtype": "float32", "shape": ["B", 1, 256]}
    for s in raw["slices"]:
        assert s["sha256"] == sha256_file(build_dir / s["file"])
        assert s["external_data"] is False


def test_dynamo_exporter_is_an_option(tmp_path: Path) -> None:
    model = random_model(QWEN2, seed=1)
    spec = SliceSpec(3, 4, 4)
    external, report = export_slice(model, spec, tmp_path / "s.onnx", ExportOptions(exporter="dynamo"))
    assert report.ok and not external
    assert max(compare_with_torch(model, spec, tmp_path / "s.onnx").values()) <= 1e-3


def test_weights_go_to_external_data_above_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_mod, "PROTOBUF_LIMIT", 64 << 20)  # anything non-empty is "above" it now
    model = random_model(LLAMA, seed=2)
    spec = SliceSpec(0, 4, 4)
    external, report = export_slice(model, spec, tmp_path / "s.onnx")
    assert external and (tmp_path / "s.onnx.data").is_file() and report.ok
    assert max(compare_with_torch(model, spec, tmp_path / "s.onnx").values()) <= 1e-3


# --- the checker catches what it claims to -------------------------------------------------------

def _graph(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto] | None = None,
           inits: list[onnx.TensorProto] | None = None, opset: int = 17) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])
    g = helper.make_graph(nodes, "g", inputs or [x], [y], initializer=inits or [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_checker_passes_a_clean_graph() -> None:
    assert check_trt_compat(_graph([helper.make_node("Relu", ["x"], ["y"])])).ok


def test_checker_catches_if_node() -> None:
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])])
    cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    m = _graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], inits=[cond])
    report = check_trt_compat(m)
    assert any("If" in e for e in report.errors)
    with pytest.raises(OnnxCompatError, match="If"):
        assert_trt_compat(m)


def test_checker_catches_minus_inf_initializer() -> None:
    mask = helper.make_tensor("mask", TensorProto.FLOAT, [4], [0.0, 0.0, float("-inf"), 0.0])
    m = _graph([helper.make_node("Add", ["x", "mask"], ["y"])], inits=[mask])
    assert any("mask" in e and "inf" in e for e in check_trt_compat(m).errors)


def test_checker_catches_int64_input() -> None:
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", 4])
    m = _graph([helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT)], inputs=[ids])
    assert any("ids" in e and "int64" in e for e in check_trt_compat(m).errors)


def test_checker_catches_attention_op_opset_and_custom_domain() -> None:
    att = _graph([helper.make_node("Attention", ["x", "x", "x"], ["y"])], opset=23)
    errors = check_trt_compat(att).errors
    assert any("Attention" in e for e in errors) and any("opset is 23" in e for e in errors)
    custom = _graph([helper.make_node("FusedMatMul", ["x", "x"], ["y"], domain="com.microsoft")])
    assert any("com.microsoft" in e for e in check_trt_compat(custom).errors)


def test_checker_catches_dynamic_unsqueeze_axes() -> None:
    axes = helper.make_tensor_value_info("axes", TensorProto.INT32, [1])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    m = _graph([helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
                helper.make_node("Squeeze", ["u", "axes"], ["y"])], inputs=[x, axes])
    assert any("axes" in e and "Unsqueeze" in e for e in check_trt_compat(m).errors)


# --- the build cache and the CLI -----------------------------------------------------------------

def test_cache_reuses_a_matching_build_only(built: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, build_dir = built
    folder, manifest = ensure_build(model_dir, SLICES, build_dir=build_dir)  # the fixture's build
    assert folder == build_dir and manifest.slices_str == SLICES
    with pytest.raises(BuildError, match="slices"):
        ensure_build(model_dir, "0:2,2:4", build_dir=build_dir)
    a, _ = ensure_build(model_dir, "0:4", cache_dir=tmp_path)
    stamp = (a / "manifest.json").stat().st_mtime_ns
    b, _ = ensure_build(model_dir, "0:4", cache_dir=tmp_path)
    assert a == b and (b / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    c, _ = ensure_build(model_dir, "0:4", cache_dir=tmp_path, options=ExportOptions(fold_constants=False))
    assert c != a


@pytest.fixture()
def cli() -> typer.Typer:
    from agent.cli import build as cli_build

    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # a group, so that `build` is a subcommand as in `orin-agent build`
        pass

    cli_build.register(app)
    return app


def test_cli_build_json(cli: typer.Typer, built: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = built
    res = CliRunner().invoke(cli, ["build", "--model", str(model_dir), "--slices", "0:2,2:4",
                                   "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [(s["start"], s["end"]) for s in data["slices"]] == [(0, 2), (2, 4)]
    assert (tmp_path / "out" / "manifest.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--slices", "0:2,2:9"], "not a non-empty range"),
    (["--slices", "0:x"], "START:END"),
    (["--slices", "0:2"], "end at layer 2"),
])
def test_cli_build_bad_slices(cli: typer.Typer, built: tuple[Path, Path], tmp_path: Path,
                              args: list[str], message: str) -> None:
    model_dir, _ = built
    res = CliRunner().invoke(cli, ["build", "--model", str(model_dir), "--out", str(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_cli_build_missing_model(cli: typer.Typer, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["build", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "does not exist" in res.output
