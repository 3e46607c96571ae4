"""Builds of a model's slices for ONNX Runtime and TensorRT. Modules: export.py (ONNX export of one
slice and its numeric check), trt_check.py and trt_versions.py (the static TensorRT-compatibility check
of an exported file, per parser version), manifest.py (manifest.json: what a build holds and when it
can be reused), builder.py (slice build orchestration and the build cache); ort_decoder.py and
decoder_build.py (the whole quantised decoder as one ONNX Runtime graph, built from the weights, no
torch). This module only wires the public names together, lazily (PEP 562), so that importing one
torch-free module of the package does not import the exporter and torch."""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Progress": "builder", "build_slices": "builder", "cache_key": "builder", "check_build": "builder",
    "default_cache_dir": "builder", "ensure_build": "builder", "resolve_slices": "builder", "slice_file": "builder",
    "MANIFEST": "manifest", "MANIFEST_FORMAT": "manifest", "BuildError": "manifest", "BuildManifest": "manifest",
    "graph_code_hash": "manifest", "load_manifest": "manifest", "mismatch": "manifest",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"partition.build.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'partition.build' has no attribute {name!r}")
