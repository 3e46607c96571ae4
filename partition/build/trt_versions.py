"""What each TensorRT version's ONNX parser accepts beyond the operators both share: the rules
`check_trt_compat(..., target=V)` adds for `orin-agent build --check-trt 8.5|8.6|10.3`.

Sources (onnx/onnx-tensorrt, docs/operators.md of each release branch, and the Python bindings):
  * 8.5-GA: "TensorRT 8.5 supports operators up to Opset 17"; the parser is built against ONNX 1.12,
    whose IR_VERSION is 8 (a newer IR is read with a warning at best, so we require <= 8).
  * 8.6-GA: opset up to 17 as well, ONNX 1.13 (IR 8). No bfloat16: `DataType.BF16` is absent from
    the 8.6.1 Python bindings (`tensorrt_bindings-8.6.1` wheel, strings of tensorrt.so) and present in
    the 10.3.0 ones (`tensorrt_cu12_bindings-10.3.0`); it arrived with TensorRT 9.
  * 10.1-GA: "TensorRT 10.0 supports operators in the inclusive range of opset 9 to opset 20"; adds
    CastLike, DeformConv, Gelu, GroupNormalization, Hardmax, IsInf, LayerNormalization, Mish to the
    8.5 list. Reduce* ops (and ReduceSum from opset 13) take `axes` as an input that must be an
    initializer or a Constant output; the 8.5 parser states the same for ReduceSum's axes.
The ONNX `Attention` op is parsed only from TensorRT 10.14 and stays banned for every target here.
"""
from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto

TRT_TARGETS = ("8.5", "8.6", "10.3")

TRT10_EXTRA_OPS = frozenset("CastLike DeformConv Gelu GroupNormalization Hardmax IsInf LayerNormalization "
                            "Mish".split())

REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
              "ReduceProd", "ReduceSum", "ReduceSumSquare")


@dataclass(frozen=True)
class ParserRules:
    """One TensorRT version's ONNX-parser limits that a static check can test."""

    version: str
    max_opset: int
    max_ir_version: int | None      # None: no limit we can state
    extra_ops: frozenset[str]       # ops parsed beyond the 8.5/10.1 common list
    bf16: bool                      # whether a bfloat16 tensor has a TensorRT type
    constant_axes_ops: tuple[str, ...]  # ops whose input 1 (`axes`) must be an initializer / Constant


RULES = {
    "8.5": ParserRules("8.5", 17, 8, frozenset(), False, ("ReduceSum",)),
    "8.6": ParserRules("8.6", 17, 8, frozenset(), False, ("ReduceSum",)),
    "10.3": ParserRules("10.3", 20, None, TRT10_EXTRA_OPS, True, REDUCE_OPS),
}

# With no target, a file must satisfy every target at once (what the exporter checks), except the IR
# version: the exporter writes the lowest IR its opset allows (export.py), and hand-made graphs in tests
# carry onnx's newest IR, so the IR limit is checked only when a version is named.
STRICTEST = ParserRules("8.5+10.3", 17, None, frozenset(), False, REDUCE_OPS)


def rules_for(target: str | None) -> ParserRules:
    """The rules of `target` ("8.5", "8.6", "10.3"; None = all of them at once)."""
    if target is None:
        return STRICTEST
    if target not in RULES:
        raise ValueError(f"TensorRT version {target!r} is not one of {', '.join(TRT_TARGETS)}")
    return RULES[target]


def unrepresentable(rules: ParserRules) -> set[int]:
    """Tensor types this version has no representation for at all."""
    kinds = {TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64, TensorProto.INT16,
             TensorProto.COMPLEX64, TensorProto.COMPLEX128, TensorProto.STRING}
    if not rules.bf16:
        kinds.add(TensorProto.BFLOAT16)
    return kinds
