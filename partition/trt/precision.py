"""The precision plan of a TensorRT slice engine: which builder flags it sets and which layers stay fp32.

Plans: "fp32"; "fp16" (FP16 kernels, RMSNorm, softmax and the residual adds kept fp32 through per-layer
precision with OBEY_PRECISION_CONSTRAINTS: TENSORRT.md); "int8-wo" / "int4-wo" (weight-only: the ONNX
must already carry the quantised weights as DequantizeLinear nodes, TensorRT's explicit quantisation;
INT8 from 8.5, INT4 blocked DQ only from 10.x). This module does not quantise: the Q/DQ rewrite of
the ONNX belongs to the weight-only quantisation work (partition.quantize), which is not in this tree
yet, so an int*-wo plan on a graph without DequantizeLinear is refused with that message. "auto"
(a measured per-layer plan, partition.trt.autoquant) is written as a plan file without TensorRT; an
engine from it needs the same Q/DQ slices and is refused for now.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "fp16", "int8-wo", "int4-wo", "auto")
LAYER_PRECISIONS = ("fp32", "fp16", "int8-wo", "int4-wo")

# ONNX node names (the ONNX parser names TensorRT layers after them) of what stays fp32, as
# partition.model exports them: RMSNorm ("/layers.N/input_layernorm/Pow", ..., "/norm/Mul"), the
# attention softmax ("/layers.N/self_attn/Softmax") and the residual adds ("/layers.N/Add", "_1").
FP32_PATTERNS = (re.compile(r"(^|/)(input_layernorm|post_attention_layernorm|norm)/"),
                 re.compile(r"Softmax"),
                 re.compile(r"^/layers\.\d+/Add(_\d+)?$"))


class PrecisionUnavailable(ValueError):
    """A precision this build, this graph or this TensorRT version cannot give."""


@dataclass(frozen=True)
class PrecisionPlan:
    """The engine's default precision and per-decoder-layer overrides (absolute layer index)."""

    default: str = "fp16"
    layers: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        for p in (self.default, *(p for _, p in self.layers)):
            if p not in LAYER_PRECISIONS:
                raise ValueError(f"precision {p!r} is not one of {', '.join(LAYER_PRECISIONS)}")

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset((self.default, *(p for _, p in self.layers)))

    @property
    def weight_only(self) -> bool:
        return bool(self.kinds & {"int8-wo", "int4-wo"})

    def key(self) -> str:
        return self.default + "".join(f",{i}={p}" for i, p in self.layers)


def plan_for(precision: str) -> PrecisionPlan:
    """The engine plan for `--precision`; "auto" is refused for engines until slices carry Q/DQ weights."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        raise PrecisionUnavailable("--precision auto writes a per-layer plan (precision_plan.json) but cannot "
                                   "build engines from it yet: weight-only engines need ONNX slices with Q/DQ "
                                   "weights, not in this build; drop --engine, or use fp16")
    return PrecisionPlan(precision)


def builder_flags(plan: PrecisionPlan, trt_major: int) -> tuple[str, ...]:
    """Names of the `trt.BuilderFlag`s to set, in order. INT4 weight-only needs TensorRT 10."""
    if "int4-wo" in plan.kinds and trt_major < 10:
        raise PrecisionUnavailable(f"int4-wo (INT4 blocked DequantizeLinear) needs TensorRT 10.x, not {trt_major}.x")
    if plan.kinds == {"fp32"}:
        return ()
    flags = ["FP16"]
    if plan.weight_only:
        flags.append("INT8")  # explicit quantisation: Q/DQ nodes are honoured only with INT8 enabled
    flags.append("OBEY_PRECISION_CONSTRAINTS")
    return tuple(flags)


def keep_fp32(layer_name: str) -> bool:
    """Whether a layer (named after its ONNX node) must run in fp32 under a reduced-precision plan."""
    return any(p.search(layer_name) for p in FP32_PATTERNS)


def check_weight_only_graph(plan: PrecisionPlan, op_counts: dict[str, int]) -> None:
    """A weight-only plan needs the quantised weights in the graph (DequantizeLinear nodes)."""
    if plan.weight_only and not op_counts.get("DequantizeLinear"):
        raise PrecisionUnavailable(f"{plan.key()}: the ONNX slices hold no DequantizeLinear nodes; weight-only "
                                   "engines need slices exported with quantised weights (partition.quantize, "
                                   "not in this build)")
