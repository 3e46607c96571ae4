"""The TensorRT runners of a build, for `load_chain(..., backend="trt")`: engines from the engine cache
(built there first when missing, which needs TensorRT and the GPU), one `TrtRunner` per slice."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from partition.build.manifest import BuildManifest
from partition.trt.cache import EngineCache
from partition.trt.engines import EngineOptions, build_engines
from partition.trt.precision import PrecisionPlan
from partition.trt.profiles import ProfileLimits
from partition.trt.runner import TrtRunner

DEFAULT_MAX_PREFILL = 512  # longest prompt chunk of the prefill profile unless the cache is shorter (our choice)


def trt_runners(folder: Path, manifest: BuildManifest, max_seq: int, max_batch: int, device: str,
                cache_dir: Path | None = None, plan: PrecisionPlan = PrecisionPlan("fp16"),
                log: Callable[[str], None] | None = None) -> list[TrtRunner]:
    limits = ProfileLimits(max_batch=max_batch, max_seq=max_seq, max_prefill=min(DEFAULT_MAX_PREFILL, max_seq))
    engines = build_engines(folder, manifest, EngineOptions(plan, limits), EngineCache(cache_dir), log=log)
    kv = (int(manifest.config["n_kv_heads"]), int(manifest.config["head_dim"]))
    return [TrtRunner(e.engine, s.spec, s.inputs, s.outputs, kv, max_seq, max_batch, device)
            for e, s in zip(engines, manifest.slices)]
