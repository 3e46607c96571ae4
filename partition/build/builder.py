"""Slice build orchestration: export every slice of a model into a folder (one ONNX file each, checked
and compared with torch) and write its manifest last; and the cache of builds that
`load_chain(..., backend="ort")` reuses. A build is reused only when model hash, slices and export
options all match and the files still hash as recorded (partition.build.manifest).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

from partition.build.export import NUMERIC_TOLERANCE, ExportError, ExportOptions, SliceExport, \
    compare_with_torch, export_slice, graph_io, sha256_file
from partition.build.manifest import MANIFEST, BuildError, BuildManifest, graph_code_hash, load_manifest, \
    mismatch, versions
from partition.build.trt_check import CheckReport, check_trt_compat
from partition.checkpoint import load_model, model_hash
from partition.config import load_config
from partition.paths import cache_root
from partition.quantize import refuse_export
from partition.slices import SliceSpec, parse_slices

# progress(index, spec, stage): stage is "export" (export + checks), "compare" or "done".
Progress = Callable[[int, SliceSpec, str], None]


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
    model = load_model(model_dir, dequantize=True)  # a GGUF's blocks as floats: the slices are float graphs
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / MANIFEST
    if stale.exists():
        stale.unlink()  # the folder is being rewritten: never leave a manifest over half a build
    done: list[SliceExport] = []
    scales, calibration = None, None
    if options.kv_cache == "int8":  # one set of scales for every slice, from the model's validation text
        from partition.build.kv_qdq import compare_int8_with_torch, corpus_kv_scales, export_int8_kv_slice

        scales, calibration = corpus_kv_scales(model, model_dir)
    for i, spec in enumerate(specs):
        if progress:
            progress(i, spec, "export")
        path = out_dir / slice_file(spec)
        if scales is not None:
            external, report = False, export_int8_kv_slice(model, spec, path, scales, options)
        else:
            external, report = export_slice(model, spec, path, options)
        diffs: dict[str, float] = {}
        if verify:
            if progress:
                progress(i, spec, "compare")
            diffs = compare_with_torch(model, spec, path) if scales is None else \
                compare_int8_with_torch(model, spec, path, scales)
            if diffs.pop("kv_int8_steps", 0.0) > 1:  # more than a rounding tie: the Q/DQ are wrong
                raise ExportError(f"slice {spec}: its INT8 K/V differ from torch's by more than one step")
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
                             versions(), _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             calibration)
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)
    return manifest


def cache_key(digest: str, specs: Sequence[SliceSpec], options: ExportOptions) -> str:
    text = f"{digest}|{','.join(map(str, specs))}|{options.key()}|{graph_code_hash()}"
    return f"{digest[:12]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def default_cache_dir() -> Path:
    return cache_root() / "builds"


def ensure_build(model_dir: str | Path, slices: str | Sequence[SliceSpec] | None = None,
                 build_dir: str | Path | None = None, cache_dir: str | Path | None = None,
                 options: ExportOptions = ExportOptions(), log: Callable[[str], None] | None = None,
                 progress: Progress | None = None, verify: bool = True) -> tuple[Path, BuildManifest]:
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
        return target, build_slices(model_dir, specs, target, options, verify=verify, progress=progress)
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
        manifest = build_slices(model_dir, specs, tmp, options, verify=verify, progress=progress)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, manifest


def check_build(build_dir: str | Path, manifest: BuildManifest, target: str) -> dict[str, CheckReport]:
    """Every slice file of a build checked against one TensorRT version's parser rules
    (`--check-trt 8.5|8.6|10.3`), by file name; a report with errors names the node or tensor."""
    build_dir = Path(build_dir)
    return {s.file: check_trt_compat(build_dir / s.file, manifest.options.opset, target) for s in manifest.slices}
