"""The engine cache: serialized engines stored under a key of everything that makes an engine valid
(ONNX file hash, TensorRT version, GPU name and SM, precision plan, optimisation profiles; not the tool
that built it: an engine from trtexec serves the API runner alike),
and one timing cache per TensorRT version and GPU. An engine is tied to its GPU and TensorRT version
(TENSORRT.md), so a lookup checks the key recorded beside the plan and the plan's hash: a stale or
corrupt entry is deleted and reported, never loaded.

Layout: <root>/<stem>.plan + <stem>.json (key, sha256, size, build seconds), <root>/timing-<trt>-<sm>.cache.
Default root: ~/.cache/orin-agent/engines (`orin-agent build --engine-cache DIR` picks another, e.g. a unit's
CacheDirectory).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from partition.paths import cache_root


def default_engine_cache() -> Path:
    return cache_root() / "engines"


@dataclass(frozen=True)
class EngineKey:
    onnx_sha256: str
    trt_version: str
    gpu_name: str
    sm: str          # e.g. "sm_87" (Orin)
    precision: str   # PrecisionPlan.key()
    profiles: str    # profiles.profiles_key()

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def stem(self) -> str:
        return f"{self.onnx_sha256[:12]}-{self.digest()[:16]}"


@dataclass(frozen=True)
class CacheLookup:
    path: Path | None   # the plan when it can be loaded
    note: str | None    # why an entry was thrown away, for the user


class EngineCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_engine_cache()

    def plan_path(self, key: EngineKey) -> Path:
        return self.root / f"{key.stem}.plan"

    def timing_cache_path(self, trt_version: str, sm: str) -> Path:
        return self.root / f"timing-{trt_version}-{sm}.cache"

    def lookup(self, key: EngineKey) -> CacheLookup:
        plan, meta = self.plan_path(key), self.plan_path(key).with_suffix(".json")
        if not plan.exists() and not meta.exists():
            return CacheLookup(None, None)
        try:
            record = json.loads(meta.read_text(encoding="utf-8"))
            stale = record.get("key") != dataclasses.asdict(key)
            corrupt = not plan.is_file() or record.get("sha256") != _sha256(plan.read_bytes())
        except (OSError, ValueError):
            stale, corrupt = False, True
        if stale or corrupt:
            self._drop(key)
            why = "was built for another key" if stale else "is corrupt or incomplete"
            return CacheLookup(None, f"cached engine {plan.name} {why}: rebuilding it")
        return CacheLookup(plan, None)

    def store(self, key: EngineKey, plan: bytes, seconds: float) -> Path:
        """Write the plan and its record atomically (plan first, record last: a plan without a record
        is an incomplete entry and gets rebuilt)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.plan_path(key)
        _atomic_write(path, plan)
        record = {"key": dataclasses.asdict(key), "sha256": _sha256(plan), "bytes": len(plan),
                  "build_seconds": round(seconds, 2)}
        _atomic_write(path.with_suffix(".json"), (json.dumps(record, indent=2) + "\n").encode())
        return path

    def load_timing_cache(self, trt_version: str, sm: str) -> bytes | None:
        path = self.timing_cache_path(trt_version, sm)
        return path.read_bytes() if path.is_file() else None

    def store_timing_cache(self, trt_version: str, sm: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.timing_cache_path(trt_version, sm), data)

    def _drop(self, key: EngineKey) -> None:
        for p in (self.plan_path(key), self.plan_path(key).with_suffix(".json")):
            p.unlink(missing_ok=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
