"""Builds one slice engine with TensorRT's Python API, using only the calls 8.5/8.6 and 10.3 share:
explicit-batch network, `OnnxParser.parse_from_file`, `set_memory_pool_limit(WORKSPACE)`, builder
flags from the precision plan with fp32 kept for RMSNorm / softmax / residual adds, one optimisation
profile per entry of `profiles` with `set_shape` on every dynamic input, a timing cache carried from
build to build, and `build_serialized_network` (None on failure: the parser's and builder's errors are
reported). Never `build_engine`, `max_workspace_size` or binding indices (gone in 10.x).

The `tensorrt` module is passed in, so tests drive this with a recording double (tests/fake_tensorrt.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

from partition.trt.api import network_flags, version_of
from partition.trt.precision import PrecisionPlan, builder_flags, keep_fp32
from partition.trt.profiles import ShapeProfile


class EngineBuildError(RuntimeError):
    """TensorRT could not parse the slice or build its engine; the message carries its errors."""


@dataclass(frozen=True)
class BuildRequest:
    onnx_path: Path
    profiles: tuple[ShapeProfile, ...]
    plan: PrecisionPlan
    workspace_bytes: int
    optimization_level: int | None = None  # 0..5, TensorRT >= 8.6; None = TensorRT's default (3)


@dataclass(frozen=True)
class BuiltEngine:
    plan: bytes
    timing_cache: bytes
    seconds: float
    fp32_layers: int


def _capturing_logger(trt: ModuleType, echo: Callable[[str], None] | None) -> object:
    """A trt.ILogger that keeps warnings and errors (to report them) and passes them to `echo`."""

    class Capture(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[str] = []

        def log(self, severity: object, msg: str) -> None:
            sev = trt.ILogger.Severity
            if severity in (sev.INTERNAL_ERROR, sev.ERROR, sev.WARNING):
                self.messages.append(str(msg))
                if echo:
                    echo(f"tensorrt: {msg}")

    return Capture()


def _dynamic_inputs(network: object) -> list[str]:
    names = []
    for i in range(network.num_inputs):  # type: ignore[attr-defined]
        tensor = network.get_input(i)  # type: ignore[attr-defined]
        if any(d < 0 for d in tuple(tensor.shape)):
            names.append(tensor.name)
    return names


def _keep_fp32(trt: ModuleType, network: object) -> int:
    """Pin RMSNorm, softmax and residual-add layers (float outputs only) to fp32; returns how many."""
    floats = (trt.float32, trt.float16)
    n = 0
    for i in range(network.num_layers):  # type: ignore[attr-defined]
        layer = network.get_layer(i)  # type: ignore[attr-defined]
        if not keep_fp32(layer.name):
            continue
        outs = range(layer.num_outputs)
        if not all(layer.get_output(j).dtype in floats for j in outs):
            continue
        layer.precision = trt.float32
        for j in outs:
            layer.set_output_type(j, trt.float32)
        n += 1
    return n


def build_engine_plan(trt: ModuleType, req: BuildRequest, timing_cache: bytes | None = None,
                      echo: Callable[[str], None] | None = None) -> BuiltEngine:
    """Parse `req.onnx_path` and build a serialized engine; raises EngineBuildError with TensorRT's
    messages when the parse or the build fails, or a dynamic input has no profile range."""
    t0 = time.monotonic()
    version = version_of(trt)
    logger = _capturing_logger(trt, echo)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, version))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(req.onnx_path)):
        errors = [f"node {e.node()}: {e.desc()}" for e in (parser.get_error(i) for i in range(parser.num_errors))]
        raise EngineBuildError(f"{req.onnx_path.name}: the TensorRT {version} ONNX parser refused it: "
                               + "; ".join(errors or logger.messages or ["no message"]))  # type: ignore[attr-defined]
    _check_profiles(_dynamic_inputs(network), req.profiles, req.onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(req.workspace_bytes))
    for flag in builder_flags(req.plan, version.major):
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if req.optimization_level is not None and version.has_optimization_level:
        config.builder_optimization_level = int(req.optimization_level)
    for prof in req.profiles:
        p = builder.create_optimization_profile()
        for r in prof.inputs:
            p.set_shape(r.name, r.min, r.opt, r.max)
        config.add_optimization_profile(p)
    pinned = _keep_fp32(trt, network) if req.plan.kinds != {"fp32"} else 0
    cache = config.create_timing_cache(timing_cache or b"")
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a cache from another device is refused
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"{req.onnx_path.name}: TensorRT {version} could not build the engine: "
                               + "; ".join(logger.messages[-5:] or ["no message"]))  # type: ignore[attr-defined]
    return BuiltEngine(bytes(serialized), bytes(config.get_timing_cache().serialize()),
                       time.monotonic() - t0, pinned)


def _check_profiles(dynamic: Sequence[str], profiles: Sequence[ShapeProfile], path: Path) -> None:
    for prof in profiles:
        have = {r.name for r in prof.inputs}
        missing = [n for n in dynamic if n not in have]
        if missing:
            raise EngineBuildError(f"{path.name}: profile {prof.name!r} has no shape range for the dynamic "
                                   f"input(s) {', '.join(missing)}")
