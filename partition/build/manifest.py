"""The build manifest: `manifest.json` beside the exported slices, which records everything needed to
trust and reuse a build: the model hash (config.json and weights), the config, the slice ranges, each
file's graph inputs/outputs with symbolic shapes and dtypes, opset, exporter, sha256, the versions of
torch / onnx / onnxruntime / onnxscript and of the graph code, and the max abs difference against the
torch slice measured at build time; for an INT8-KV build (`kv_cache`), where its cache scales were
calibrated (`kv_calibration`). Also the rule that says when a build can serve (`mismatch`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from partition.build.export import ExportOptions, SliceExport, TensorSpec, sha256_file
from partition.slices import SliceSpec

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

class BuildError(RuntimeError):
    """A build that cannot be made or reused; the message says which and what to do."""


@dataclass(frozen=True)
class BuildManifest:
    model_dir: str
    model_hash: str
    config: dict[str, Any]
    options: ExportOptions
    slices: tuple[SliceExport, ...]
    versions: dict[str, str]
    created: str
    kv_calibration: dict[str, Any] | None = None  # INT8-KV builds: the scales' data and method

    @property
    def slices_str(self) -> str:
        return ",".join(str(s.spec) for s in self.slices)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "model_dir": self.model_dir,
            "model_hash": self.model_hash,
            "config": self.config,
            "exporter": self.options.exporter,
            "opset": self.options.opset,
            "export_options": dataclasses.asdict(self.options),
            "kv_cache": self.options.kv_cache,
            "kv_calibration": self.kv_calibration,
            "versions": self.versions,
            "created": self.created,
            "slices": [{
                "start": s.spec.start, "end": s.spec.end, "file": s.file, "sha256": s.sha256,
                "external_data": s.external_data,
                "inputs": [dataclasses.asdict(t) for t in s.inputs],
                "outputs": [dataclasses.asdict(t) for t in s.outputs],
                "max_abs_diff": s.max_abs_diff, "op_counts": s.op_counts, "warnings": list(s.warnings),
            } for s in self.slices],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "BuildManifest":
        if raw.get("format") != MANIFEST_FORMAT:
            raise BuildError(f"manifest format {raw.get('format')} is not {MANIFEST_FORMAT}: rebuild")
        n = int(raw["config"]["n_layers"])

        def tensors(items: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in items)

        return cls(
            model_dir=raw["model_dir"], model_hash=raw["model_hash"], config=raw["config"],
            options=ExportOptions(**raw["export_options"]),
            slices=tuple(SliceExport(SliceSpec(s["start"], s["end"], n), s["file"], s["sha256"],
                                     tensors(s["inputs"]), tensors(s["outputs"]), s["external_data"],
                                     s["max_abs_diff"], s["op_counts"], tuple(s["warnings"]))
                         for s in raw["slices"]),
            versions=raw["versions"], created=raw["created"], kv_calibration=raw.get("kv_calibration"))


def graph_code_hash() -> str:
    """sha256 of the source that shapes the exported graph (model definition and exporter): a cached
    build made by other code is stale even when the weights and options match."""
    from partition import model
    from partition.build import export, kv_qdq

    h = hashlib.sha256()
    for mod in (model, export, kv_qdq):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    """The library and graph-code versions a build records."""
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "onnxscript": onnxscript.__version__, "graph_code": graph_code_hash()}


def load_manifest(build_dir: str | Path) -> BuildManifest:
    path = Path(build_dir) / MANIFEST
    if not path.is_file():
        raise BuildError(f"{path}: no manifest; {build_dir} is not a complete build")
    try:
        return BuildManifest.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BuildError(f"{path}: unreadable manifest ({exc}); rebuild") from None


def mismatch(manifest: BuildManifest, build_dir: Path, digest: str, specs: Sequence[SliceSpec],
             options: ExportOptions, check_files: bool = True) -> str | None:
    """Why this build cannot serve (model, slices, options, files), or None when it can."""
    if manifest.model_hash != digest:
        return "it was built from different weights or config"
    if [s.spec for s in manifest.slices] != list(specs):
        return f"its slices are {manifest.slices_str}, not {','.join(map(str, specs))}"
    if manifest.options.kv_cache != options.kv_cache:
        return (f"its KV-cache is {manifest.options.kv_cache}, not {options.kv_cache} (make one with "
                f"`orin-agent build --kv-cache {options.kv_cache} --out DIR`)")
    if manifest.options != options:
        return f"it was exported with {manifest.options.key()}, not {options.key()}"
    if manifest.versions.get("graph_code") != graph_code_hash():
        return "it was exported by another version of the model or exporter code"
    for s in manifest.slices if check_files else ():
        path = build_dir / s.file
        if not path.is_file() or sha256_file(path) != s.sha256:
            return f"{s.file} is missing or changed since the build"
    return None
