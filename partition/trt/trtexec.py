"""The `trtexec` alternative to the API builder (`orin-agent build --engine trt --builder trtexec`):
the same profiles, precision flags, fp32 layers, workspace and timing cache as one command line, and
the TensorRT version read from trtexec's banner. trtexec ships with JetPack in /usr/src/tensorrt/bin/.

Flags (trtexec --help of 8.5/8.6/10.x): --onnx, --saveEngine, --memPoolSize=workspace:N (MiB when
no unit is given), --minShapes/--optShapes/--maxShapes (one group per optimisation profile, in
order), --fp16, --int8, --precisionConstraints=obey with --layerPrecisions/--layerOutputTypes
name:fp32, --timingCacheFile, --builderOptimizationLevel (8.6+), and --skipInference (8.6+; 8.5's
spelling is --buildOnly). NOT verified: that 8.5's trtexec builds several profiles from repeated
shape groups (a maintainer said trtexec had no multiple profiles in 8.4, NVIDIA/TensorRT#1590); the
API builder is the default for that reason.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from partition.trt.api import TrtVersion
from partition.trt.precision import PrecisionPlan, builder_flags, keep_fp32
from partition.trt.profiles import ShapeProfile, shape_text

DEFAULT_TRTEXEC = "/usr/src/tensorrt/bin/trtexec"  # JetPack's location (TENSORRT.md)

_FLAG_ARGS = {"FP16": "--fp16", "INT8": "--int8", "OBEY_PRECISION_CONSTRAINTS": "--precisionConstraints=obey"}


def _shapes(profile: ShapeProfile, which: str) -> str:
    return ",".join(f"{r.name}:{shape_text(getattr(r, which))}" for r in profile.inputs)


def fp32_node_names(node_names: Sequence[str]) -> list[str]:
    """The ONNX nodes (TensorRT layers are named after them) that a reduced-precision plan pins to fp32."""
    return [n for n in node_names if n and keep_fp32(n)]


def trtexec_command(onnx_path: Path, engine_path: Path, profiles: Sequence[ShapeProfile], plan: PrecisionPlan,
                    workspace_mb: int, timing_cache: Path, version: TrtVersion, fp32_layers: Sequence[str] = (),
                    optimization_level: int | None = None, trtexec: str = DEFAULT_TRTEXEC) -> list[str]:
    """The trtexec argv that builds the same engine as partition.trt.api_builder.build_engine_plan."""
    cmd = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={engine_path}", f"--memPoolSize=workspace:{int(workspace_mb)}",
           f"--timingCacheFile={timing_cache}"]
    for p in profiles:
        cmd += [f"--minShapes={_shapes(p, 'min')}", f"--optShapes={_shapes(p, 'opt')}",
                f"--maxShapes={_shapes(p, 'max')}"]
    flags = builder_flags(plan, version.major)
    cmd += [_FLAG_ARGS[f] for f in flags]
    if "OBEY_PRECISION_CONSTRAINTS" in flags and fp32_layers:
        spec = ",".join(f"{name}:fp32" for name in fp32_layers)
        cmd += [f"--layerPrecisions={spec}", f"--layerOutputTypes={spec}"]
    if optimization_level is not None and version.has_optimization_level:
        cmd.append(f"--builderOptimizationLevel={int(optimization_level)}")
    cmd.append("--skipInference" if version.has_optimization_level else "--buildOnly")
    return cmd


def parse_banner_version(text: str) -> TrtVersion:
    """TensorRT's version from trtexec's banner, '[TensorRT v8502]' or '[TensorRT v100300]'."""
    m = re.search(r"TensorRT v(\d+)", text)
    if not m:
        raise ValueError("trtexec printed no '[TensorRT vNNNN]' banner")
    n = int(m.group(1))
    if n >= 100000:  # 10.x and later: MMmmpp
        return TrtVersion(n // 10000, n // 100 % 100, n % 100)
    return TrtVersion(n // 1000, n // 100 % 10, n % 100)  # 8.x: Mmpp
