"""A static TensorRT-compatibility check for exported slices, run where TensorRT is absent.

What it checks, on the ONNX graph alone (`check_trt_compat`):
  * the default-domain opset is the target (17: parsed by TensorRT 8.5 and 10.x, TENSORRT.md);
  * every node is in the default ONNX domain (no contrib / custom ops, no model-local functions)
    and its op type is in the operator list that the ONNX-TensorRT parser of BOTH 8.5 and 10.1
    marks "Y" (`TRT_COMMON_OPS`, below, with its source);
  * none of the ops our rules ban although the parser may take them: `If`, `Loop`, `Scan` (Python
    branches / loops on shapes, TENSORRT.md rule 6) and the ONNX `Attention` op (parsed only from
    TensorRT 10.14, rule 1);
  * per target version (`target`, rules and sources in trt_versions.py): the newest opset and IR
    version its parser takes, the ops it adds, whether bfloat16 exists, Reduce* `axes` as constants;
  * the parser's documented input restrictions that apply to our graphs: the `axes` input of
    Slice / Squeeze / Unsqueeze, `K` of TopK and `axis` of CumSum must be initializers or Constant
    outputs;
  * graph inputs and outputs are float32 / float16 / int32 / bool: no int64 (TensorRT 8.5 truncates
    it with warnings, rule 5), no double, no string;
  * no tensor type TensorRT 8.5 cannot represent anywhere in the (shape-inferred) graph: bfloat16,
    uint16/32/64, int16, complex, string;
  * initializers and Constant / ConstantOfShape values hold no NaN or +-inf (finite masks only:
    -inf becomes NaN in fp16, rule 4).

What it does NOT prove: that TensorRT builds an engine from the file, nor the numerics in fp16.
The parser can still refuse a node for reasons the operator table does not list (shape-tensor
rank limits, dynamic shapes it cannot resolve, a type of an intermediate shape computation; the
table's "Supported Types" column is not enforced here because the 8.5 importer casts int64 shape
arithmetic down to int32 itself, e.g. `ConstantOfShape` is documented FP32-only yet imports any
value but UINT8 (builtin_op_importers.cpp, 8.5-GA)). Only `trtexec --onnx=...` or
`trt.OnnxParser.parse_from_file` on a board (or a GPU machine with TensorRT) proves parseability.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from partition.build.trt_versions import rules_for, unrepresentable

TARGET_OPSET = 17

# Operators marked supported ("Y") by the ONNX-TensorRT parser in BOTH TensorRT 8.5 and 10.1 (10.1
# only adds CastLike, DeformConv, Gelu, GroupNormalization, Hardmax, IsInf, LayerNormalization and
# Mish, none of which we may emit while 8.5 is a target). Source: onnx/onnx-tensorrt docs/operators.md,
# branch 8.5-GA (commit fdeeaca87ad2, "TensorRT 8.5 supports operators up to Opset 17") and branch
# 10.1-GA (commit 96e781103cfc, "TensorRT 10.0 supports operators in the inclusive range of opset 9 to
# opset 20").
TRT_COMMON_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil
Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
GridSample GRU HardSigmoid HardSwish Identity If ImageScaler InstanceNormalization IsNaN LeakyRelu
Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool LRN LSTM MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round
ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice
Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK
Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# Parsed, but banned by our own rules (TENSORRT.md rules 1 and 6).
BANNED_OPS = {
    "If": "a Python branch on a tensor became an `If` node (blocks fusion, fails on older TensorRT)",
    "Loop": "a Python loop on a tensor became a `Loop` node",
    "Scan": "a `Scan` node (recurrent control flow) is not allowed in a slice",
    "Attention": "the ONNX `Attention` op is parsed only from TensorRT 10.14: export MatMul + Softmax",
}

# (op, input index) that onnx-tensorrt 8.5's operators.md requires to be an initializer / constant.
CONSTANT_INPUTS = {("Slice", 3): "axes", ("Squeeze", 1): "axes", ("Unsqueeze", 1): "axes",
                   ("TopK", 1): "K", ("CumSum", 1): "axis"}

IO_TYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.INT32: "int32",
            TensorProto.BOOL: "bool"}

# Q/DQ as TensorRT 8.5-10.x take them (explicit INT8 quantization): the scale a build-time constant
# scalar or 1-D tensor (per-tensor / per-channel; TensorRT 8.6.1 operator docs, Dequantize: "The
# scale tensor must be a build-time constant scalar or a 1D tensor"), the zero point a constant of
# zeros (onnx-tensorrt operators.md: "`x_zero_point` must be zero"; TensorRT is symmetric-only), and
# INT8. Block-wise scales need opset 21's `block_size`, which no target parses (10.x takes opset
# <= 20), and TensorRT 10 blocks only INT4 weights. An INT8 graph input is allowed only straight into
# DequantizeLinear, an INT8 graph output only straight out of QuantizeLinear (the INT8 KV-cache I/O).
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class CheckReport:
    """Result of `check_trt_compat`: `errors` make the file unfit for TensorRT 8.5 / 10.x."""

    errors: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    op_counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


class OnnxCompatError(ValueError):
    """An exported slice that TensorRT 8.5 / 10.x would not parse (or that breaks our export rules)."""


def _type_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem).lower()


def _nonfinite(t: TensorProto, base_dir: Path | None) -> int:
    if t.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16):
        return 0
    arr = numpy_helper.to_array(t, base_dir=str(base_dir) if base_dir else "")
    return int(np.count_nonzero(~np.isfinite(np.asarray(arr, dtype=np.float32))))


def check_trt_compat(model: onnx.ModelProto | str | Path, opset: int = TARGET_OPSET,
                     target: str | None = None) -> CheckReport:
    """Statically check an ONNX model against what TensorRT parses and our export rules: `target`
    "8.5", "8.6" or "10.3" adds that version's parser rules (trt_versions.py); None checks 8.5 and
    10.x at once.

    Pass a path for a model with external data (weights are then read from beside it). See the
    module docstring for exactly what this does and does not prove.
    """
    rules = rules_for(target)
    bad_types = unrepresentable(rules)
    base_dir: Path | None = None
    if not isinstance(model, onnx.ModelProto):
        base_dir = Path(model).parent
        model = onnx.load(str(model), load_external_data=False)
    errors: list[str] = []
    warnings: list[str] = []

    versions = {imp.domain or "ai.onnx": imp.version for imp in model.opset_import}
    if versions.get("ai.onnx") != opset:
        errors.append(f"default-domain opset is {versions.get('ai.onnx')}, expected {opset} "
                      "(opset 17 is what TensorRT 8.5 and 10.x both parse)")
    if versions.get("ai.onnx", 0) > rules.max_opset:
        errors.append(f"default-domain opset {versions.get('ai.onnx')} is above {rules.max_opset}, the newest "
                      f"the TensorRT {rules.version} parser takes")
    if rules.max_ir_version is not None and model.ir_version > rules.max_ir_version:
        errors.append(f"ONNX IR version {model.ir_version} is newer than {rules.max_ir_version}, what the TensorRT "
                      f"{rules.version} parser expects")
    for dom in versions:
        if dom != "ai.onnx":
            errors.append(f"opset import of non-standard domain {dom!r}: TensorRT parses only ONNX ops")
    if model.functions:
        errors.append(f"{len(model.functions)} model-local function(s) "
                      f"({', '.join(f.name for f in model.functions)}): inline them before TensorRT")

    g = model.graph
    constants = {t.name for t in g.initializer}
    constants |= {o for n in g.node if n.op_type == "Constant" for o in n.output}
    counts: dict[str, int] = {}
    for node in g.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        where = f"node {node.name or node.output[0]!r} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            errors.append(f"{where}: op of domain {node.domain!r}; TensorRT parses only default-domain ops")
        elif node.op_type in BANNED_OPS:
            errors.append(f"{where}: {BANNED_OPS[node.op_type]}")
        elif node.op_type not in TRT_COMMON_OPS | rules.extra_ops:
            errors.append(f"{where}: not in the ONNX-TensorRT {rules.version} supported-operator list")
        if node.op_type in rules.constant_axes_ops and len(node.input) > 1 and node.input[1] and \
                node.input[1] not in constants:
            errors.append(f"{where}: input `axes` must be an initializer or constant for TensorRT {rules.version}")
        for (op, idx), what in CONSTANT_INPUTS.items():
            if node.op_type == op and len(node.input) > idx and node.input[idx] and \
                    node.input[idx] not in constants:
                errors.append(f"{where}: input `{what}` must be an initializer or constant for TensorRT")
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and _nonfinite(attr.t, base_dir):
                errors.append(f"{where}: attribute {attr.name!r} holds NaN or inf")
            if attr.type == onnx.AttributeProto.GRAPH:
                errors.append(f"{where}: has a subgraph attribute {attr.name!r} (control flow)")

    errors += _qdq_errors(g, rules.version)
    for t in g.initializer:
        bad = _nonfinite(t, base_dir)
        if bad:
            errors.append(f"initializer {t.name!r}: {bad} NaN/inf value(s); masks must be finite")
        if t.data_type in bad_types:
            errors.append(f"initializer {t.name!r}: type {_type_name(t.data_type)} has no TensorRT {rules.version} type")

    for kind, values in (("input", g.input), ("output", g.output)):
        for v in values:
            if v.name in constants:
                continue  # an initializer listed as a graph input (IR < 4 style): not a real input
            elem = v.type.tensor_type.elem_type
            if elem == TensorProto.INT8 and _int8_io_ok(g, v.name, kind):
                continue
            if elem not in IO_TYPES:
                errors.append(f"graph {kind} {v.name!r} is {_type_name(elem)}; allowed: "
                              f"{', '.join(IO_TYPES.values())} (ids and positions int32)")
            dims = v.type.tensor_type.shape.dim
            if any(not d.dim_param and not d.HasField("dim_value") for d in dims):
                warnings.append(f"graph {kind} {v.name!r} has an unnamed dynamic dimension")

    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        for v in inferred.graph.value_info:
            if v.type.tensor_type.elem_type in bad_types:
                errors.append(f"tensor {v.name!r} is {_type_name(v.type.tensor_type.elem_type)}: "
                              f"no TensorRT {rules.version} type")
    except onnx.shape_inference.InferenceError as exc:
        errors.append(f"ONNX shape inference failed: {exc}")
    return CheckReport(tuple(errors), tuple(warnings), dict(sorted(counts.items())))


def _int8_io_ok(g: onnx.GraphProto, name: str, kind: str) -> bool:
    """An INT8 graph input read only by DequantizeLinear, or an INT8 output written by QuantizeLinear."""
    if kind == "input":
        users = [n for n in g.node if name in n.input]
        return bool(users) and all(n.op_type == "DequantizeLinear" and n.input[0] == name for n in users)
    return any(n.op_type == "QuantizeLinear" and name in n.output for n in g.node)


def _qdq_errors(g: onnx.GraphProto, version: str) -> list[str]:
    """TensorRT's constraints on QuantizeLinear / DequantizeLinear (QDQ_OPS above)."""
    inits = {t.name: t for t in g.initializer}
    consts = {o: n.attribute[0].t for n in g.node if n.op_type == "Constant" and n.attribute for o in n.output}
    out: list[str] = []
    for node in (n for n in g.node if n.op_type in QDQ_OPS):
        where = f"node {node.name or node.output[0]!r} ({node.op_type})"
        for idx, what in ((1, "scale"), (2, "zero point")):
            if len(node.input) <= idx or not node.input[idx]:
                if idx == 2 and node.op_type == "QuantizeLinear":
                    out.append(f"{where}: no zero point: QuantizeLinear then outputs uint8, not INT8")
                continue
            t = inits.get(node.input[idx]) or consts.get(node.input[idx])
            if t is None:
                out.append(f"{where}: the {what} must be a build-time constant for TensorRT {version}")
                continue
            if len(t.dims) > 1:
                out.append(f"{where}: a {len(t.dims)}-D {what} (block-wise); TensorRT {version} takes a scalar "
                           "or 1-D (per-channel) one")
            if idx == 2 and (t.data_type != TensorProto.INT8 or np.any(numpy_helper.to_array(t) != 0)):
                out.append(f"{where}: the zero point must be INT8 zeros (TensorRT is symmetric)")
        if any(a.name == "block_size" for a in node.attribute):
            out.append(f"{where}: block-wise Q/DQ (opset 21) is not parsed by TensorRT {version}")
    return out


def assert_trt_compat(model: onnx.ModelProto | str | Path, opset: int = TARGET_OPSET,
                      target: str | None = None) -> CheckReport:
    """`check_trt_compat`, raising OnnxCompatError listing every problem when there is one."""
    report = check_trt_compat(model, opset, target)
    if not report.ok:
        name = model if not isinstance(model, onnx.ModelProto) else model.graph.name
        raise OnnxCompatError(f"{name}: not TensorRT{' ' + target if target else ''}-compatible:\n  " + "\n  ".join(report.errors))
    return report


def check_onnx_file(path: str | Path, opset: int = TARGET_OPSET) -> CheckReport:
    """onnx.checker (full check, with shape inference; external data found beside the file), then
    `assert_trt_compat`. Raises onnx.checker.ValidationError or OnnxCompatError."""
    onnx.checker.check_model(str(path), full_check=True)
    return assert_trt_compat(path, opset)
