"""INT8 KV-cache I/O in an exported slice (partition/build/kv_qdq.py): the graph has Q/DQ around every
past / new K/V, passes the TensorRT check of 8.5, 8.6 and 10.3, ONNX Runtime runs it with an INT8
cache and greedy tokens equal the torch runner's INT8 path on the shipped model; the check refuses
the Q/DQ forms TensorRT does not take (run-time or block-wise scales, non-zero zero points, an INT8
input that is not dequantised)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from partition.build.kv_qdq import calibrate_kv_scales, export_int8_kv_slice
from partition.build.trt_check import check_trt_compat
from partition.checkpoint import load_model
from partition.paths import DEFAULT_MODEL_DIR
from partition.runners.ort_runner import OrtRunner
from partition.runners.torch_runner import TorchRunner
from partition.slices import SliceSpec
from partition.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def int8_slices(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model = load_model(DEFAULT_MODEL_DIR)
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    text = (ROOT / "kernels" / "kv_quant.py").read_text() + (ROOT / "partition" / "model.py").read_text()
    scales = calibrate_kv_scales(model, torch.tensor(tok.encode(text)[:1024]))
    out = tmp_path_factory.mktemp("int8kv")
    n = model.config.n_layers
    specs = [SliceSpec(0, 3, n), SliceSpec(3, n, n)]
    for s in specs:
        export_int8_kv_slice(model, s, out / f"s{s.start}.onnx", scales)
    return model, tok, specs, out


def test_graph_has_int8_cache_io_and_passes_every_trt_target(int8_slices: tuple) -> None:
    model, _, specs, out = int8_slices
    for s in specs:
        path = out / f"s{s.start}.onnx"
        g = onnx.load(str(path)).graph
        kv = [v for v in (*g.input, *g.output) if v.name.startswith(("past_", "new_"))]
        assert len(kv) == 4 * s.n_layers and all(v.type.tensor_type.elem_type == TensorProto.INT8 for v in kv)
        counts = {op: sum(n.op_type == op for n in g.node) for op in ("QuantizeLinear", "DequantizeLinear")}
        assert counts == {"QuantizeLinear": 2 * s.n_layers, "DequantizeLinear": 2 * s.n_layers}
        for version in ("8.5", "8.6", "10.3"):
            assert check_trt_compat(path, target=version).errors == (), version


def test_ort_greedy_equals_the_torch_int8_path(int8_slices: tuple) -> None:
    from partition.runners.chain import Chain

    model, tok, specs, out = int8_slices
    n = model.config.n_layers
    ort_chain = Chain([OrtRunner(out / f"s{s.start}.onnx", s, 160, 1) for s in specs])
    assert ort_chain.runners[0].cache[0].dtype == np.int8
    torch_int8 = TorchRunner(model, SliceSpec(0, n, n), 160, 1, kv_cache="int8")
    for prompt in ("def parse(source, filename):", "class Queue:\n    def __init__(self"):
        ids = tok.encode(prompt)
        assert greedy_ids(ort_chain.forward, ids, 32) == greedy_ids(torch_int8.run, ids, 32), prompt


def greedy_ids(step: Callable[..., object], ids: list[int], n: int) -> list[int]:
    """n greedy tokens from a one-row step function (a runner's `run` or a chain's `forward`, cache row 0)."""
    out: list[int] = []
    pos = np.arange(len(ids), dtype=np.int32)[None]
    logits = step(np.asarray([ids], np.int32), pos, [0])
    for _ in range(n):
        out.append(int(np.asarray(logits).reshape(-1).argmax()))
        pos = pos[:, -1:] + 1
        logits = step(np.asarray([[out[-1]]], np.int32), pos, [0])
    return out


def _qdq_graph(scale: np.ndarray, zero: np.ndarray, scale_as_input: bool = False, into: str = "DequantizeLinear"
               ) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.INT8, [1, 2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 4])
    inits = [numpy_helper.from_array(zero, "zp")]
    inputs = [x]
    if scale_as_input:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, list(scale.shape)))
    else:
        inits.append(numpy_helper.from_array(scale, "s"))
    node = (helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["y"], axis=3) if into == "DequantizeLinear"
            else helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT))
    g = helper.make_graph([node], "g", inputs, [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_trt_check_refuses_qdq_forms_tensorrt_does_not_take() -> None:
    ok = _qdq_graph(np.full(4, 0.1, np.float32), np.zeros(4, np.int8))
    assert check_trt_compat(ok, target="8.5").errors == ()
    cases = {
        "build-time constant": _qdq_graph(np.full(4, 0.1, np.float32), np.zeros(4, np.int8), scale_as_input=True),
        "block-wise": _qdq_graph(np.full((1, 2, 3, 4), 0.1, np.float32), np.zeros((1, 2, 3, 4), np.int8)),
        "symmetric": _qdq_graph(np.full(4, 0.1, np.float32), np.ones(4, np.int8)),
        "'x' is int8": _qdq_graph(np.full(4, 0.1, np.float32), np.zeros(4, np.int8), into="Cast"),
    }
    for what, graph in cases.items():
        errors = check_trt_compat(graph, target="8.5").errors
        assert any(what in e for e in errors), (what, errors)
