"""The TensorRT runners of a build, for `load_chain(..., backend="trt")`: engines from the engine cache
(built there first when missing, which needs TensorRT and the GPU), one `TrtRunner` per slice; and the
engine options `orin-agent build --engine trt` uses, so that both agree on the cache key."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from partition.build.manifest import BuildManifest
from partition.runners.base import default_max_seq
from partition.trt.cache import EngineCache
from partition.trt.engines import EngineOptions, SliceEngine, build_engines
from partition.trt.precision import plan_for
from partition.trt.profiles import ProfileLimits
from partition.trt.runner import TrtRunner

DEFAULT_MAX_PREFILL = 512  # longest prompt chunk of the prefill profile unless the cache is shorter (our choice)


def trt_runners(folder: Path, manifest: BuildManifest, max_seq: int, max_batch: int, device: str,
                cache_dir: Path | None = None, precision: str = "fp16",
                log: Callable[[str], None] | None = None) -> list[TrtRunner]:
    opts = engine_options(precision, max_batch, max_seq)
    engines = build_engines(folder, manifest, opts, EngineCache(cache_dir), log=log)
    kv = (int(manifest.config["n_kv_heads"]), int(manifest.config["head_dim"]))
    return [TrtRunner(e.engine, s.spec, s.inputs, s.outputs, kv, max_seq, max_batch, device,
                      max_prefill=opts.limits.max_prefill) for e, s in zip(engines, manifest.slices)]


def engine_options(precision: str, max_batch: int, max_seq: int, builder: str = "api",
                   workspace_mb: int | None = None) -> EngineOptions:
    """The options `orin-agent build --engine trt` builds with; the profile limits are the ones
    `load_chain(..., backend="trt")` asks for with the same max_batch / max_seq, so its lookups hit."""
    limits = ProfileLimits(max_batch=max_batch, max_seq=max_seq, max_prefill=min(DEFAULT_MAX_PREFILL, max_seq))
    return EngineOptions(plan_for(precision), limits, builder=builder, workspace_mb=workspace_mb)


def build_slice_engines(folder: Path, manifest: BuildManifest, precision: str = "fp16", builder: str = "api",
                        workspace_mb: int | None = None, max_batch: int = 1, max_seq: int | None = None,
                        cache_dir: Path | None = None, log: Callable[[str], None] | None = None) -> list[SliceEngine]:
    """`orin-agent build --engine trt`: an engine per slice of the build in `folder`, for the same
    max_batch / max_seq defaults as `load_chain` (the model's context capped at MAX_SEQ_CAP)."""
    seq = max_seq or default_max_seq(manifest.config["max_position_embeddings"])
    opts = engine_options(precision, max_batch, seq, builder, workspace_mb)
    return build_engines(folder, manifest, opts, EngineCache(cache_dir), log=log)
