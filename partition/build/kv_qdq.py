"""INT8 KV-cache I/O for an exported slice: QuantizeLinear / DequantizeLinear around the past and new
K/V, in the form every TensorRT target parses.

What TensorRT takes decides the form (sources in partition/build/trt_check.py, QDQ_OPS):
  * the torch runner's scheme (per token, per group of head_dim channels, scales computed from the
    data at run time) needs block-wise Q/DQ with run-time scales: `block_size` exists only from ONNX
    opset 21, which none of TensorRT 8.5 / 8.6 / 10.3 parses (10.x: opsets <= 20), TensorRT 8.x wants
    the scale a build-time constant scalar or 1-D tensor, and TensorRT 10 blocks only INT4 weights;
  * so the slice gets static per-channel scales: one FP32 scale per channel of head_dim, per layer and
    per K / V, shared by every token and KV head, calibrated offline (absmax over held-out text / 127)
    and stored as initializers. Past K/V come in as INT8 and are dequantised before attention; the
    step's new K/V leave through QuantizeLinear as INT8. The current chunk attends its own new K/V
    unquantised, as the torch runner does.
The quality cost of static against dynamic group-wise scales is measured in docs/BENCHMARKS.md
(`scripts/bench_kv_onnx.py`).

`int8_kv_graph` rewrites an exported graph; `calibrate_kv_scales` computes the scales (`corpus_kv_scales`:
on the model's validation split, as `orin-agent build --kv-cache int8` does); `export_int8_kv_slice`
exports, rewrites, saves and checks one slice; `compare_int8_with_torch` is its numeric check. The graph keeps export.py's names (past_key_{i}, ...,
new_value_{i}); only their type changes to int8, and OrtRunner sizes its cache from that type.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kernels.kv_quant import QMAX
from partition.build.export import ExportOptions, example_inputs, export_slice
from partition.build.trt_check import CheckReport, check_onnx_file
from partition.model import SliceModule, Transformer
from partition.slices import SliceSpec

CALIB_TOKENS = 4096  # as scripts/bench_kv_onnx.py, whose figures docs/BENCHMARKS.md reports
CALIB_WINDOW = 256


def kv_names(spec: SliceSpec) -> list[tuple[str, str]]:
    """(past input, new output) name pairs of a slice, in layer order, K then V."""
    return [(f"past_{w}_{i}", f"new_{w}_{i}") for i in range(spec.start, spec.end) for w in ("key", "value")]


@torch.inference_mode()
def calibrate_kv_scales(model: Transformer, ids: torch.Tensor, window: int = CALIB_WINDOW) -> dict[str, np.ndarray]:
    """Per-channel scales {"key_{i}" / "value_{i}": (head_dim,) float32} for every layer: absmax over
    the K/V that `ids` (1-D token ids, cut into `window`-token pieces) produce, over tokens and KV
    heads, / 127."""
    cfg = model.config
    sm = model.slice(0, cfg.n_layers)
    amax = torch.zeros(2 * cfg.n_layers, cfg.head_dim)
    empty = [torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    for a in range(0, ids.numel() - window + 1, window):
        x = ids[a:a + window][None].int()
        _, *new = sm(x, torch.arange(window, dtype=torch.int32)[None], *empty)
        for j, t in enumerate(new):
            amax[j] = torch.maximum(amax[j], t.float().abs().amax(dim=(0, 1, 2)))
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return {f"{'key' if j % 2 == 0 else 'value'}_{j // 2}": scale[j].numpy().astype(np.float32)
            for j in range(2 * cfg.n_layers)}


def int8_kv_graph(proto: onnx.ModelProto, spec: SliceSpec, scales: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Rewrite an exported slice (in place, returned): each past K/V input becomes INT8 and goes through
    DequantizeLinear (axis 3, head_dim); each new K/V output is the FP tensor through QuantizeLinear."""
    g = proto.graph
    inputs = {v.name: v for v in g.input}
    outputs = {v.name: v for v in g.output}
    head_dim = len(next(iter(scales.values())))
    zero = numpy_helper.from_array(np.zeros(head_dim, dtype=np.int8), "kv_zero_point")  # the scale's shape
    g.initializer.append(zero)
    added: list[onnx.NodeProto] = []
    for past, new in kv_names(spec):
        w, i = past.split("_")[1], int(past.split("_")[2])
        s_name = f"kv_scale_{w}_{i}"
        g.initializer.append(numpy_helper.from_array(np.asarray(scales[f"{w}_{i}"], dtype=np.float32), s_name))
        deq = f"{past}_dequantized"
        for node in g.node:  # every reader of the FP past now reads the dequantised INT8 one
            for k, name in enumerate(node.input):
                if name == past:
                    node.input[k] = deq
        inputs[past].type.tensor_type.elem_type = TensorProto.INT8
        added.append(helper.make_node("DequantizeLinear", [past, s_name, zero.name], [deq], name=f"dq_{past}", axis=3))
        fp = f"{new}_float"
        for node in g.node:  # the FP new K/V keeps feeding attention under another name
            node.output[:] = [fp if o == new else o for o in node.output]
            for k, name in enumerate(node.input):
                if name == new:
                    node.input[k] = fp
        outputs[new].type.tensor_type.elem_type = TensorProto.INT8
        added.append(helper.make_node("QuantizeLinear", [fp, s_name, zero.name], [new], name=f"q_{new}", axis=3))
    # DequantizeLinear first (graph inputs only), QuantizeLinear last: the node list stays topological
    dqs = [n for n in added if n.op_type == "DequantizeLinear"]
    qs = [n for n in added if n.op_type == "QuantizeLinear"]
    nodes = dqs + list(g.node) + qs
    del g.node[:]
    g.node.extend(nodes)
    return proto


def export_int8_kv_slice(model: Transformer, spec: SliceSpec, path: str | Path, scales: dict[str, np.ndarray],
                         options: ExportOptions = ExportOptions()) -> CheckReport:
    """Export layers [spec.start, spec.end) with INT8 K/V I/O to `path`; onnx.checker and the TensorRT
    check must pass (raises otherwise, as export_slice). Returns the TensorRT-compatibility report."""
    path = Path(path)
    external, _ = export_slice(model, spec, path, options)
    if external:
        raise ValueError(f"slice {spec}: weights above 2 GB; the INT8-KV rewrite handles single-file slices")
    proto = int8_kv_graph(onnx.load(str(path)), spec, scales)
    onnx.save(proto, str(path))
    return check_onnx_file(path, options.opset)


def corpus_kv_scales(model: Transformer, model_dir: str | Path, tokens: int = CALIB_TOKENS
                     ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Scales calibrated on the first `tokens` tokens of the model's validation split (corpus.json,
    sha256-checked; never the test split), and the record of where they came from (for the manifest)."""
    from partition.exits.data import split_texts
    from partition.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    eos = tok.tk.token_to_id("<|endoftext|>")
    texts = split_texts(Path(model_dir), "val")
    ids = [t for x in texts for t in tok.encode(x) + ([eos] if eos is not None else [])][:tokens]
    scales = calibrate_kv_scales(model, torch.tensor(ids))
    h = hashlib.sha256()
    for k in sorted(scales):
        h.update(k.encode() + scales[k].tobytes())
    record = {"source": "calibrated at build time", "data": "corpus.json 'val' split (shuffled, seed 0)",
              "texts": len(texts), "tokens": len(ids), "window": CALIB_WINDOW,
              "method": "per channel of head_dim, per layer and K/V: absmax over tokens and KV heads / 127",
              "scales_sha256": h.hexdigest()[:16]}
    return scales, record


def compare_int8_with_torch(model: Transformer, spec: SliceSpec, path: str | Path,
                            scales: dict[str, np.ndarray]) -> dict[str, float]:
    """The INT8-KV slice on ONNX Runtime (CPU) against the torch slice fed the same dequantised past:
    max abs diff of the hidden states / logits for a prefill (B=1, T=7, P=0) and a decode (B=2, T=1,
    P=9, random INT8 past), and "kv_int8_steps": the most the INT8 new K/V differ from torch's K/V
    quantised with the same scales (1 = a rounding tie broken the other way)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    module = SliceModule(model, spec.start, spec.end).eval()
    names = [i.name for i in sess.get_inputs()]
    s = [torch.from_numpy(scales[p.split("_", 1)[1]]) for p, _ in kv_names(spec)]
    gen = torch.Generator().manual_seed(1)
    diffs: dict[str, float] = {"kv_int8_steps": 0.0}
    for case, (b, pos, past_len) in {"prefill": (1, np.arange(7, dtype=np.int32)[None], 0),
                                     "decode": (2, np.array([[5], [9]], dtype=np.int32), 9)}.items():
        x, positions, *past = example_inputs(model, spec, b, pos, past_len, seed=1)
        q = [torch.randint(-QMAX, QMAX + 1, p.shape, generator=gen, dtype=torch.int8) for p in past]
        with torch.no_grad():
            want = module(x, positions, *[qi.float() * si for qi, si in zip(q, s)])
        got = sess.run(None, {n: a.numpy() for n, a in zip(names, [x, positions, *q])})
        diffs[case] = float(np.max(np.abs(got[0] - want[0].numpy())))
        for g, w, si in zip(got[1:], want[1:], s):
            ref = torch.clamp(torch.round(w / si), -128, 127).numpy()
            diffs["kv_int8_steps"] = max(diffs["kv_int8_steps"], float(np.max(np.abs(g.astype(np.float32) - ref))))
    return diffs
