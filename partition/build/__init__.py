"""Builds of a model's slices for ONNX Runtime and TensorRT. Modules: export.py (ONNX export of one
slice and its numeric check), trt_check.py and trt_versions.py (the static TensorRT-compatibility check
of an exported file, per parser version), manifest.py (manifest.json: what a build holds and when it
can be reused), builder.py (slice build orchestration and the build cache). This module only wires the
public names together."""
from partition.build.builder import Progress, build_slices, cache_key, check_build, default_cache_dir, \
    ensure_build, resolve_slices, slice_file
from partition.build.manifest import MANIFEST, MANIFEST_FORMAT, BuildError, BuildManifest, graph_code_hash, \
    load_manifest, mismatch

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "BuildError", "BuildManifest", "Progress", "build_slices", "cache_key",
           "check_build", "default_cache_dir", "ensure_build", "graph_code_hash", "load_manifest", "mismatch",
           "resolve_slices", "slice_file"]
