"""Builds: a folder of exported slices (one ONNX file each) plus `manifest.json`, and the cache of
builds that `load_chain(..., backend="ort")` reuses.

A manifest records everything needed to trust and reuse a build: the model hash (config.json and
weights), the config, the slice ranges, each file's graph inputs/outputs with symbolic shapes and
dtypes, opset, exporter, sha256, the versions of torch / onnx / onnxruntime / onnxscript, and the
max abs difference against the torch slice measured at build time. A build is reused only when
model hash, slices and export options all match and the files still hash as recorded.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from partition.checkpoint import load_model, model_hash
from partition.config import load_config
from partition.quantize import refuse_export
from partition.export import (NUMERIC_TOLERANCE, ExportError, ExportOptions, SliceExport, TensorSpec,
                              compare_with_torch, export_slice, graph_io, sha256_file)
from partition.runners.base import SliceSpec, parse_slices

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

# progress(index, spec, stage): stage is "export" (export + checks), "compare" or "done".
Progress = Callable[[int, SliceSpec, str], None]


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
            versions=raw["versions"], created=raw["created"])


def graph_code_hash() -> str:
    """sha256 of the source that shapes the exported graph (model definition and exporter): a cached
    build made by other code is stale even when the weights and options match."""
    from partition import export, model

    h = hashlib.sha256()
    for mod in (model, export):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "onnxscript": onnxscript.__version__, "graph_code": graph_code_hash()}


def slice_file(spec: SliceSpec) -> str:
    return f"slice_{spec.start:02d}_{spec.end:02d}.onnx"


def resolve_slices(model_dir: Path, slices: str | Sequence[SliceSpec] | None) -> list[SliceSpec]:
    """'0:4,4:8' (or SliceSpecs, or None = one slice of every layer), checked against the model."""
    n = load_config(model_dir).n_layers
    if slices is None:
        return [SliceSpec(0, n, n)]
    if isinstance(slices, str):
        return parse_slices(slices, n)
    return list(slices)


def build_slices(model_dir: str | Path, slices: str | Sequence[SliceSpec] | None, out_dir: str | Path,
                 options: ExportOptions = ExportOptions(), verify: bool = True,
                 progress: Progress | None = None) -> BuildManifest:
    """Export every slice of the model in `model_dir` into `out_dir`, check each file (onnx.checker
    and onnx_check), compare it with the torch slice (unless verify=False) and write manifest.json
    last, so a folder with a manifest is always a complete build. Raises BuildError / ExportError."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    specs = resolve_slices(model_dir, slices)
    digest = model_hash(model_dir)
    refuse_export(model_dir)
    model = load_model(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / MANIFEST
    if stale.exists():
        stale.unlink()  # the folder is being rewritten: never leave a manifest over half a build
    done: list[SliceExport] = []
    for i, spec in enumerate(specs):
        if progress:
            progress(i, spec, "export")
        path = out_dir / slice_file(spec)
        external, report = export_slice(model, spec, path, options)
        diffs: dict[str, float] = {}
        if verify:
            if progress:
                progress(i, spec, "compare")
            diffs = compare_with_torch(model, spec, path)
            worst = max(diffs.values())
            if not worst <= NUMERIC_TOLERANCE:  # also catches NaN
                raise ExportError(f"slice {spec}: ONNX Runtime and torch differ by {worst:.3g} "
                                  f"(> {NUMERIC_TOLERANCE}) on {diffs}")
        ins, outs = graph_io(path)
        done.append(SliceExport(spec, path.name, sha256_file(path), ins, outs, external, diffs,
                                report.op_counts, report.warnings))
        if progress:
            progress(i, spec, "done")
    manifest = BuildManifest(str(model_dir.resolve()), digest, model.config.to_dict(), options, tuple(done),
                             _versions(), _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)
    return manifest


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
    if manifest.options != options:
        return f"it was exported with {manifest.options.key()}, not {options.key()}"
    if manifest.versions.get("graph_code") != graph_code_hash():
        return "it was exported by another version of the model or exporter code"
    for s in manifest.slices if check_files else ():
        path = build_dir / s.file
        if not path.is_file() or sha256_file(path) != s.sha256:
            return f"{s.file} is missing or changed since the build"
    return None


def cache_key(digest: str, specs: Sequence[SliceSpec], options: ExportOptions) -> str:
    text = f"{digest}|{','.join(map(str, specs))}|{options.key()}|{graph_code_hash()}"
    return f"{digest[:12]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "orin-agent" / "builds"


def ensure_build(model_dir: str | Path, slices: str | Sequence[SliceSpec] | None = None,
                 build_dir: str | Path | None = None, cache_dir: str | Path | None = None,
                 options: ExportOptions = ExportOptions(), log: Callable[[str], None] | None = None,
                 progress: Progress | None = None) -> tuple[Path, BuildManifest]:
    """A build of these slices of this model with these options: reused when one matches, exported
    otherwise. `build_dir` names the folder exactly (an `orin-agent build --out` folder, reused if it
    matches, built into if empty, refused if it holds a different build); without it the build lives
    in `cache_dir` (default ~/.cache/orin-agent/builds) under a key of model hash, slices, options."""
    model_dir = Path(model_dir)
    refuse_export(model_dir)
    specs = resolve_slices(model_dir, slices)
    digest = model_hash(model_dir)
    if build_dir is not None:
        target = Path(build_dir)
        if (target / MANIFEST).exists():
            manifest = load_manifest(target)
            why = mismatch(manifest, target, digest, specs, options)
            if why:
                raise BuildError(f"{target}: cannot reuse this build: {why}; pass another build folder "
                                 "or delete this one")
            return target, manifest
        if target.exists() and any(target.iterdir()):
            raise BuildError(f"{target}: not empty and not a build (no {MANIFEST}); pass an empty folder")
        if log:
            log(f"exporting slices {','.join(map(str, specs))} of {model_dir} to {target} ...")
        return target, build_slices(model_dir, specs, target, options, progress=progress)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / cache_key(digest, specs, options)
    if (target / MANIFEST).exists():
        try:
            manifest = load_manifest(target)
            if mismatch(manifest, target, digest, specs, options) is None:
                return target, manifest
        except BuildError:
            pass  # a damaged cache entry: rebuild it below
    if log:
        log(f"exporting slices {','.join(map(str, specs))} of {model_dir} to the build cache {target} "
            "(once; later runs reuse it) ...")
    # Build beside the target and rename, so a concurrent or interrupted build never leaves a
    # half-written folder under the key.
    tmp = root / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest = build_slices(model_dir, specs, tmp, options, progress=progress)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, manifest
