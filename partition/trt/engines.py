"""Slice engine build orchestration: for each ONNX slice of a build, the engine from the cache or a
fresh build (API or trtexec), one slice at a time with the builder freed in between (the builder
holds several times the slice's weights in memory), the workspace sized from free memory, progress and
time per slice, and `engines.json` in the build folder for the runner. A half-finished build resumes:
slices whose engines are already cached are not rebuilt.
"""
from __future__ import annotations

import gc
import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from partition.build.export import SliceExport
from partition.build.manifest import BuildManifest
from partition.trt.api import TrtVersion, load_tensorrt, version_of
from partition.trt.api_builder import BuildRequest, EngineBuildError, build_engine_plan
from partition.trt.cache import EngineCache, EngineKey
from partition.trt.precision import PrecisionPlan, check_weight_only_graph
from partition.trt.profiles import ProfileLimits, ShapeProfile, build_profiles, profiles_key
from partition.trt.trtexec import DEFAULT_TRTEXEC, fp32_node_names, parse_banner_version, trtexec_command

ENGINES = "engines.json"
BUILDERS = ("api", "trtexec")
MIN_WORKSPACE = 256 << 20   # below this TensorRT has too few tactics for a decoder layer (our choice)
MAX_WORKSPACE = 4 << 30     # more buys nothing for slices of this size (our choice)


@dataclass(frozen=True)
class EngineOptions:
    plan: PrecisionPlan
    limits: ProfileLimits
    builder: str = "api"
    workspace_mb: int | None = None         # None: sized from free memory
    optimization_level: int | None = None
    trtexec: str = DEFAULT_TRTEXEC

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise ValueError(f"builder {self.builder!r} is not one of {', '.join(BUILDERS)}")


@dataclass(frozen=True)
class SliceEngine:
    slice: str
    onnx_file: str
    engine: str
    key: str
    cached: bool
    seconds: float


@dataclass(frozen=True)
class Device:
    name: str
    sm: str
    free_bytes: int


def workspace_bytes(requested_mb: int | None, free_bytes: int, onnx_bytes: int) -> int:
    """The builder's workspace: what was asked for, else a quarter of the memory left once the builder's
    own copies of the weights (taken as 3x the ONNX file) are set aside, clamped to [256 MiB, 4 GiB]."""
    if requested_mb is not None:
        if requested_mb <= 0:
            raise ValueError(f"--workspace-mb must be positive, not {requested_mb}")
        return requested_mb << 20
    spare = max(0, free_bytes - 3 * onnx_bytes) // 4
    return max(MIN_WORKSPACE, min(MAX_WORKSPACE, spare))


def current_device() -> Device:
    """The CUDA device engines are built for (an engine is tied to it)."""
    import torch

    if not torch.cuda.is_available():
        raise EngineBuildError("no CUDA device: TensorRT engines are built on the GPU that runs them")
    major, minor = torch.cuda.get_device_capability()
    free, _ = torch.cuda.mem_get_info()
    return Device(torch.cuda.get_device_name(), f"sm_{major}{minor}", int(free))


def trtexec_path(trtexec: str) -> str:
    """`trtexec` as given when it exists, else the one on PATH (JetPack does not put it there)."""
    return trtexec if Path(trtexec).is_file() else shutil.which("trtexec") or trtexec


def trtexec_version(trtexec: str) -> TrtVersion:
    trtexec = trtexec_path(trtexec)
    try:
        out = subprocess.run([trtexec, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineBuildError(f"cannot run {trtexec}: {exc}") from None
    return parse_banner_version(out.stdout + out.stderr)


def engine_key(s: SliceExport, opts: EngineOptions, version: TrtVersion, device: Device) -> EngineKey:
    profiles = build_profiles(s.inputs, opts.limits)
    return EngineKey(s.sha256, str(version), device.name, device.sm, opts.plan.key(), profiles_key(profiles))


def build_engines(build_dir: Path, manifest: BuildManifest, opts: EngineOptions, cache: EngineCache,
                  device: Device | None = None, log: Callable[[str], None] | None = None) -> list[SliceEngine]:
    """An engine per slice of the build in `build_dir`, from `cache` or built now; writes engines.json."""
    say = log or (lambda _m: None)
    for s in manifest.slices:
        check_weight_only_graph(opts.plan, s.op_counts)
    trt = load_tensorrt() if opts.builder == "api" else None
    version = version_of(trt) if trt is not None else trtexec_version(opts.trtexec)
    device = device or current_device()
    timing = cache.load_timing_cache(str(version), device.sm)
    done: list[SliceEngine] = []
    for i, s in enumerate(manifest.slices):
        key = engine_key(s, opts, version, device)
        found = cache.lookup(key)
        if found.note:
            say(found.note)
        if found.path is not None:
            say(f"slice {s.spec} ({i + 1}/{len(manifest.slices)}): engine in the cache, {found.path}")
            done.append(SliceEngine(str(s.spec), s.file, str(found.path), key.stem, True, 0.0))
            continue
        onnx_path = build_dir / s.file
        ws = workspace_bytes(opts.workspace_mb, device.free_bytes, onnx_path.stat().st_size)
        say(f"slice {s.spec} ({i + 1}/{len(manifest.slices)}): building a {opts.plan.key()} engine with TensorRT "
            f"{version} ({opts.builder}, workspace {ws >> 20} MiB) ...")
        profiles = build_profiles(s.inputs, opts.limits)
        if trt is not None:
            built = build_engine_plan(trt, BuildRequest(onnx_path, profiles, opts.plan, ws, opts.optimization_level),
                                      timing, say)
            plan, seconds, timing = built.plan, built.seconds, built.timing_cache
            cache.store_timing_cache(str(version), device.sm, timing)
        else:
            plan, seconds = _run_trtexec(onnx_path, cache, key, profiles, opts, ws, version, device)
        path = cache.store(key, plan, seconds)
        del plan
        gc.collect()  # free the builder's memory before the next slice
        say(f"slice {s.spec}: built in {seconds:.1f} s -> {path}")
        done.append(SliceEngine(str(s.spec), s.file, str(path), key.stem, False, seconds))
    (build_dir / ENGINES).write_text(json.dumps({"tensorrt": str(version), "gpu": device.name, "sm": device.sm,
                                                 "precision": opts.plan.key(), "limits": asdict(opts.limits),
                                                 "engines": [asdict(e) for e in done]}, indent=2) + "\n",
                                     encoding="utf-8")
    return done


def _run_trtexec(onnx_path: Path, cache: EngineCache, key: EngineKey, profiles: tuple[ShapeProfile, ...], opts: EngineOptions,
                 ws: int, version: TrtVersion, device: Device) -> tuple[bytes, float]:
    import onnx

    nodes = [n.name for n in onnx.load(str(onnx_path), load_external_data=False).graph.node]
    out = cache.plan_path(key).with_name(f".{key.stem}.trtexec.plan")
    cache.root.mkdir(parents=True, exist_ok=True)
    cmd = trtexec_command(onnx_path, out, profiles, opts.plan, ws >> 20, cache.timing_cache_path(str(version), device.sm),
                          version, fp32_node_names(nodes), opts.optimization_level, trtexec_path(opts.trtexec))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise EngineBuildError(f"{onnx_path.name}: trtexec failed ({proc.returncode}): {' | '.join(tail)}")
    data = out.read_bytes()
    out.unlink()
    return data, time.monotonic() - t0
