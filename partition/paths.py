"""Where things live: the shipped small model (relative to the installed package), and the cache of what
orin-agent builds and converts (`cache_root`).

The model folder is committed at ``<checkout>/models/<name>`` and installed as package data of
``partition.shipped_models`` (setup.py maps that package onto ``models/``), so a wheel or a
non-editable ``pip install .`` carries it; an editable install finds it in the checkout.
"""
from __future__ import annotations

import os
from pathlib import Path

SHIPPED_MODEL_NAME = "stdlib-llama-8l"
_HERE = Path(__file__).resolve().parent
# installed (wheel / non-editable): site-packages/partition/shipped_models/<name>;
# editable or a plain checkout: <checkout>/models/<name>
_CANDIDATES = (_HERE / "shipped_models" / SHIPPED_MODEL_NAME, _HERE.parent / "models" / SHIPPED_MODEL_NAME)


def shipped_model_dir() -> Path:
    """The shipped model's folder: the first candidate that holds a ``config.json``."""
    for cand in _CANDIDATES:
        if (cand / "config.json").is_file():
            return cand
    return _CANDIDATES[-1]


DEFAULT_MODEL_DIR: Path = shipped_model_dir()


def cache_root() -> Path:
    """Where orin-agent keeps what it builds and converts (ONNX slices and decoder graphs under builds/, TensorRT
    engines under engines/, GGUF files' model folders under models/, kernels/ort_q4.c's library under native/):
    systemd's CacheDirectory= for the service (CACHE_DIRECTORY; the unit's home is read-only under
    ProtectHome=read-only, so ~/.cache there cannot be written), else $XDG_CACHE_HOME/orin-agent, else
    ~/.cache/orin-agent. (kernels/ort_q4.py applies the same rule itself: kernels import nothing above them.)"""
    unit = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if unit:
        return Path(unit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orin-agent"
