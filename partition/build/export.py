"""ONNX export of one slice (`SliceModule`) under the rules of TENSORRT.md, and its numeric check.

Graph contract (names are what the runners and the TensorRT engine build bind by):
  inputs   input_ids int32 (B, T)  [first slice]   or   hidden_states float32 (B, T, D)
           positions int32 (B, T)
           past_key_{i}, past_value_{i} float32 (B, KV, P, hd)   i = absolute layer index
  outputs  logits float32 (B, 1, V)  [last slice]   or   hidden_states_out float32 (B, T, D)
           new_key_{i}, new_value_{i} float32 (B, KV, T, hd)
B, T and P are dynamic; past slot k of row b is attended iff k < positions[b, 0] (model.py).

Two exporters (torch 2.13 has both; findings in docs/BENCHMARKS.md and the build report):
  * "torchscript" (default): the legacy `torch.onnx.export(..., dynamo=False)`. Emits opset 17
    directly, exports in ~0.1 s for a small slice. TENSORRT.md: the dynamo exporter's ONNX failed on
    TensorRT 8.6/9.0 in reports, so the legacy one is the default while 8.5 is a target.
  * "dynamo": `torch.onnx.export(..., dynamo=True, dynamic_shapes=...)`. It emits opset 18 (its
    in-export down-conversion to 17 fails on ReduceMean's `axes` input before the graph is
    optimised), so we export at 18, let it optimise, and convert the result to 17 with
    onnx.version_converter (and drop an attribute it leaves behind). Smaller graph (541 vs 732 nodes
    for 8 layers, no shape arithmetic for `view`), same ORT speed, but 3-7 s per slice to export here
    against 0.3-1.5 s.
Both are followed by onnxscript's optimizer (constant folding, dead-code removal: standard ONNX ops
only, unlike ORT's offline optimiser that adds com.microsoft imports), then onnx.checker and our
TensorRT-compatibility check (onnx_check.py). Weights go to external data when above 2 GB (the
protobuf limit).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from partition.build.trt_check import TARGET_OPSET, CheckReport, check_onnx_file
from partition.model import SliceModule, Transformer
from partition.slices import SliceSpec

EXPORTERS = ("torchscript", "dynamo")
KV_CACHES = ("fp16", "int8")  # fp16: the graph contract above; int8: Q/DQ around the K/V I/O (kv_qdq.py)
PROTOBUF_LIMIT = 2 * 1024 ** 3  # a ModelProto cannot be serialised above 2 GB
NUMERIC_TOLERANCE = 1e-3  # fp32 max abs diff, ORT vs torch: the build's acceptance bound


class ExportError(RuntimeError):
    """A slice that could not be exported, failed a check, or disagrees with the torch slice."""


@dataclass(frozen=True)
class ExportOptions:
    """What changes the exported bytes; part of the build cache key."""

    exporter: str = "torchscript"
    opset: int = TARGET_OPSET
    fold_constants: bool = True
    kv_cache: str = "fp16"

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter {self.exporter!r} is not one of {', '.join(EXPORTERS)}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv cache {self.kv_cache!r} is not one of {', '.join(KV_CACHES)}")

    def key(self) -> str:
        kv = "" if self.kv_cache == "fp16" else f"-kv{self.kv_cache}"  # fp16 keys as before this option
        return f"{self.exporter}-op{self.opset}{'-fold' if self.fold_constants else ''}{kv}"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, numpy dtype name, symbolic shape (str = dynamic dim)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class SliceExport:
    """One exported slice, as recorded in the build manifest."""

    spec: SliceSpec
    file: str
    sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    external_data: bool
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def io_specs(model: Transformer, spec: SliceSpec) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's inputs and outputs for a slice, in call order (see the module docstring)."""
    cfg = model.config
    kv = (cfg.n_kv_heads, cfg.head_dim)
    first = (TensorSpec("input_ids", "int32", ("B", "T")) if spec.is_first
             else TensorSpec("hidden_states", "float32", ("B", "T", cfg.hidden_size)))
    inputs = [first, TensorSpec("positions", "int32", ("B", "T"))]
    outputs = [TensorSpec("logits", "float32", ("B", 1, cfg.vocab_size)) if spec.is_last
               else TensorSpec("hidden_states_out", "float32", ("B", "T", cfg.hidden_size))]
    for i in range(spec.start, spec.end):
        inputs += [TensorSpec(f"past_{w}_{i}", "float32", ("B", kv[0], "P", kv[1])) for w in ("key", "value")]
        outputs += [TensorSpec(f"new_{w}_{i}", "float32", ("B", kv[0], "T", kv[1])) for w in ("key", "value")]
    return tuple(inputs), tuple(outputs)


def example_inputs(model: Transformer, spec: SliceSpec, batch: int, positions: np.ndarray,
                   past_len: int, seed: int = 0) -> list[torch.Tensor]:
    """Inputs in graph order: random ids / hidden states and past K/V (past slots beyond a row's
    start are garbage on purpose: the mask must hide them)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    t = positions.shape[1]
    if spec.is_first:
        x = torch.randint(0, cfg.vocab_size, (batch, t), generator=gen, dtype=torch.int32)
    else:
        x = torch.randn(batch, t, cfg.hidden_size, generator=gen)
    past = [torch.randn(batch, cfg.n_kv_heads, past_len, cfg.head_dim, generator=gen)
            for _ in range(2 * spec.n_layers)]
    return [x, torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int32)), *past]


def _trace_inputs(model: Transformer, spec: SliceSpec) -> list[torch.Tensor]:
    # Example sizes >= 2 for every dynamic dim (B=2, T=3, P=4): a size of 0 or 1 gets specialised
    # into a constant by torch.export (TENSORRT.md, rule 2), and is ambiguous for the tracer too.
    pos = np.arange(4, 7, dtype=np.int32)[None].repeat(2, 0)
    return example_inputs(model, spec, 2, pos, 4)


def _export_torchscript(module: SliceModule, args: list[torch.Tensor], names_in: list[str],
                        names_out: list[str], dyn: dict[str, dict[int, str]], path: Path, opset: int) -> None:
    with warnings.catch_warnings():
        # The legacy exporter warns that it is deprecated since torch 2.9; it is still the one whose
        # output TensorRT 8.5 is known to parse (TENSORRT.md).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, tuple(args), str(path), input_names=names_in, output_names=names_out,
                          dynamic_axes=dyn, opset_version=opset, do_constant_folding=True, dynamo=False)


def _export_dynamo(module: SliceModule, args: list[torch.Tensor], names_in: list[str],
                   names_out: list[str], n_past: int, path: Path, opset: int) -> None:
    B = torch.export.Dim("B", min=1, max=1024)
    T = torch.export.Dim("T", min=1, max=1 << 17)
    P = torch.export.Dim("P", min=0, max=1 << 17)
    # forward(x, positions, *past): varargs are one tuple in torch.export's input structure.
    x_dims = {0: B, 1: T}
    shapes = (x_dims, {0: B, 1: T}, tuple({0: B, 2: P} for _ in range(n_past)))
    quiet = logging.getLogger("torch.onnx")  # it logs missing torchvision ops and per-step banners
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        # opset 18 (the exporter's native one): asking for 17 makes it try a conversion that fails on
        # ReduceMean before optimisation and prints a traceback; we convert after optimising instead.
        prog = torch.onnx.export(module, tuple(args), input_names=names_in, output_names=names_out,
                                 dynamic_shapes=shapes, opset_version=max(opset, 18), dynamo=True,
                                 optimize=True, verbose=False)
    quiet.setLevel(level)
    prog.save(str(path), external_data=False)


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxscript.optimizer  # imported late: it pulls in a lot

    return onnxscript.optimizer.optimize(model)


def _name_output_dims(model: onnx.ModelProto, outputs: tuple[TensorSpec, ...]) -> None:
    """Give graph outputs the manifest's symbolic shapes (the tracer leaves names like
    'Addnew_key_0_dim_3' where shape inference lost a static head_dim)."""
    by_name = {o.name: o for o in outputs}
    for v in model.graph.output:
        want = by_name[v.name].shape
        dims = v.type.tensor_type.shape.dim
        if len(dims) != len(want):
            continue
        for d, w in zip(dims, want):
            if isinstance(w, int):
                d.Clear()
                d.dim_value = w
            else:
                d.Clear()
                d.dim_param = w


def _save(model: onnx.ModelProto, path: Path) -> bool:
    """Save, with weights as external data beside the file when they pass the protobuf limit."""
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    external = weight_bytes > PROTOBUF_LIMIT - (64 << 20)  # leave room for the graph itself
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return external


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_slice(model: Transformer, spec: SliceSpec, path: str | Path,
                 options: ExportOptions = ExportOptions()) -> tuple[bool, CheckReport]:
    """Export layers [spec.start, spec.end) of `model` (fp32) to `path` and check the file.

    Returns (weights stored as external data?, the TensorRT-compatibility report). Raises ExportError
    when the exporter fails or a check does not pass.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = SliceModule(model, spec.start, spec.end).eval()
    ins, outs = io_specs(model, spec)
    names_in, names_out = [t.name for t in ins], [t.name for t in outs]
    args = _trace_inputs(model, spec)
    with tempfile.TemporaryDirectory(prefix="orin-export-") as tmp:
        raw = Path(tmp) / "raw.onnx"
        try:
            with torch.no_grad():
                if options.exporter == "torchscript":
                    dyn: dict[str, dict[int, str]] = {}
                    for t in (*ins, *outs):
                        dyn[t.name] = {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
                    _export_torchscript(module, args, names_in, names_out, dyn, raw, options.opset)
                else:
                    _export_dynamo(module, args, names_in, names_out, 2 * spec.n_layers, raw, options.opset)
        except Exception as exc:  # the exporters raise many unrelated types; report them as one
            raise ExportError(f"slice {spec}: {options.exporter} export failed: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        proto = onnx.load(str(raw))  # loads any external data the exporter wrote beside it
    if options.fold_constants:
        proto = _fold(proto)
    if _opset(proto) != options.opset:
        from onnx import version_converter

        proto = version_converter.convert_version(proto, options.opset)
        _drop_new_reduce_attrs(proto, options.opset)
    _name_output_dims(proto, outs)
    # The lowest IR version the opset allows (8 for opset 17): the dynamo exporter writes 10, which
    # TensorRT 8.5's parser (built with ONNX 1.12, IR 8) does not expect (trt_versions.py).
    proto.ir_version = min(proto.ir_version, onnx.helper.find_min_ir_version_for(list(proto.opset_import)))
    proto.graph.name = f"slice_{spec.start}_{spec.end}"
    external = _save(proto, path)
    try:
        report = check_onnx_file(path, options.opset)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ExportError(f"slice {spec}: exported file {path} failed its checks: {exc}") from exc
    return external, report


def _drop_new_reduce_attrs(model: onnx.ModelProto, opset: int) -> None:
    """onnx.version_converter (1.23) moves ReduceMean/Max/... `axes` from input (opset 18) back to an
    attribute for 17 but keeps `noop_with_empty_axes`, which those ops only gained in 18: onnx.checker
    then rejects the file. Drop it where it has its default (0), refuse otherwise."""
    if opset >= 18:
        return
    for node in model.graph.node:
        if node.op_type.startswith("Reduce") and node.op_type != "ReduceSum":
            for attr in list(node.attribute):
                if attr.name == "noop_with_empty_axes":
                    if attr.i:
                        raise ExportError(f"{node.name}: noop_with_empty_axes=1 has no opset {opset} form")
                    node.attribute.remove(attr)


def _opset(model: onnx.ModelProto) -> int | None:
    return next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), None)


def graph_io(path: str | Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs as written in the file (names, dtypes, symbolic shapes)."""
    m = onnx.load(str(path), load_external_data=False)

    def spec(v: Any) -> TensorSpec:
        tt = v.type.tensor_type
        dims = tuple(d.dim_param if d.dim_param else int(d.dim_value) for d in tt.shape.dim)
        return TensorSpec(v.name, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name, dims)

    inits = {t.name for t in m.graph.initializer}
    return (tuple(spec(v) for v in m.graph.input if v.name not in inits),
            tuple(spec(v) for v in m.graph.output))


def compare_with_torch(model: Transformer, spec: SliceSpec, path: str | Path) -> dict[str, float]:
    """Max abs diff (over every output) between ONNX Runtime (CPU) on the file and the torch slice,
    fp32, for a prefill shape (B=1, T=7, P=0) and a decode shape (B=2, T=1, P=9, rows at different
    lengths so the mask hides garbage past slots)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    module = SliceModule(model, spec.start, spec.end).eval()
    names = [i.name for i in sess.get_inputs()]
    cases = {
        "prefill": (1, np.arange(7, dtype=np.int32)[None], 0),
        "decode": (2, np.array([[5], [9]], dtype=np.int32), 9),
    }
    diffs: dict[str, float] = {}
    for case, (b, pos, past_len) in cases.items():
        args = example_inputs(model, spec, b, pos, past_len, seed=1)
        with torch.no_grad():
            want = module(*args)
        got = sess.run(None, {n: a.numpy() for n, a in zip(names, args)})
        diffs[case] = max(float(np.max(np.abs(g - w.numpy()))) if g.size else 0.0
                          for g, w in zip(got, want))
    return diffs
