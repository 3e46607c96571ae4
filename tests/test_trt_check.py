"""Per-version TensorRT ONNX-parser rules (`check_trt_compat(..., target=V)`, `--check-trt V`): each
rule fails the version it applies to, names the node or tensor, and leaves the other versions alone."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partition.build.trt_check import check_trt_compat
from partition.build.trt_versions import TRT_TARGETS, rules_for


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto] | None = None,
           inits: list[onnx.TensorProto] | None = None, opset: int = 17, ir: int = 8) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 1])
    g = helper.make_graph(nodes, "g", inputs or [x], [y], initializer=inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def _errors(m: onnx.ModelProto, target: str | None, opset: int = 17) -> tuple[str, ...]:
    return check_trt_compat(m, opset, target).errors


def test_a_clean_graph_passes_every_target() -> None:
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    m = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum")], inits=[axes])
    for target in (*TRT_TARGETS, None):
        assert _errors(m, target) == ()


def test_ir_version_newer_than_the_85_parser_fails_85_only() -> None:
    m = _model([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1])], ir=9)
    assert any("IR version 9" in e for e in _errors(m, "8.5"))
    assert any("IR version 9" in e for e in _errors(m, "8.6"))
    assert _errors(m, "10.3") == ()


def test_bfloat16_has_no_type_before_trt9() -> None:
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [4], [1.0, 2.0, 3.0, 4.0])
    m = _model([helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
                helper.make_node("Mul", ["x", "w32"], ["xm"]),
                helper.make_node("ReduceMax", ["xm"], ["y"], axes=[1])], inits=[w])
    assert any("'w'" in e and "bfloat16" in e and "8.5" in e for e in _errors(m, "8.5"))
    assert any("bfloat16" in e for e in _errors(m, "8.6"))
    assert _errors(m, "10.3") == ()


def test_ops_added_in_10x_pass_10x_and_fail_85() -> None:
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    m = _model([helper.make_node("LayerNormalization", ["x", "scale"], ["n"], name="ln", axis=-1),
                helper.make_node("ReduceSum", ["n", "axes"], ["y"])], inits=[scale, axes])
    assert any("'ln'" in e and "8.5" in e for e in _errors(m, "8.5"))
    assert _errors(m, "10.3") == ()


def test_non_initializer_reduce_axes_fail_with_the_node_named() -> None:
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    sum17 = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="the_sum")], inputs=[x, axes])
    for target in TRT_TARGETS:
        assert any("the_sum" in e and "axes" in e for e in _errors(sum17, target)), target
    mean18 = _model([helper.make_node("ReduceMean", ["x", "axes"], ["y"], name="the_mean")], inputs=[x, axes],
                    opset=18)
    assert any("the_mean" in e and "axes" in e for e in _errors(mean18, "10.3", opset=18))
    assert any("opset 18 is above 17" in e for e in _errors(mean18, "8.5", opset=18))


def test_if_node_and_int64_input_fail_every_target_named() -> None:
    branch = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 1])])
    cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    with_if = _model([helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch,
                                       else_branch=branch)], inits=[cond])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", 4])
    int64 = _model([helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
                    helper.make_node("ReduceMax", ["f"], ["y"], axes=[1])], inputs=[ids])
    for target in TRT_TARGETS:
        assert any("'branchy'" in e and "If" in e for e in _errors(with_if, target))
        assert any("'ids'" in e and "int64" in e for e in _errors(int64, target))


def test_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="9.0"):
        rules_for("9.0")


def test_cli_check_trt_reuses_the_build_and_reports(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from agent.cli import app
    from partition.checkpoint import random_model, save_model
    from partition.config import ModelConfig

    model = tmp_path / "model"
    save_model(random_model(ModelConfig("LlamaForCausalLM", 320, 64, 4, 4, 2, 16, 128,
                                        max_position_embeddings=64), seed=1), model)
    out = tmp_path / "b"
    base = ["build", "--model", str(model), "--slices", "0:2,2:4", "--out", str(out), "--no-verify"]
    cli = CliRunner()
    assert cli.invoke(app, base).exit_code == 0
    stamp = (out / "manifest.json").stat().st_mtime_ns
    for version in ("10.3", "8.5"):
        res = cli.invoke(app, [*base, "--check-trt", version, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["trt_check"] == {"version": version, "errors": []}
    assert (out / "manifest.json").stat().st_mtime_ns == stamp  # reused, not exported again
    res = cli.invoke(app, [*base, "--check-trt", "9.0"])
    assert res.exit_code == 2 and "9.0" in res.output
    if importlib.util.find_spec("tensorrt") is None:  # where TensorRT exists this would build engines
        res = cli.invoke(app, [*base, "--engine", "trt"])
        assert res.exit_code == 2 and "python3-libnvinfer" in res.output
