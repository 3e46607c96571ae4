"""Where things live relative to the installed package: the shipped small model.

The model folder is committed at ``<checkout>/models/<name>`` and installed as package data of
``partition.shipped_models`` (setup.py maps that package onto ``models/``), so a wheel or a
non-editable ``pip install .`` carries it; an editable install finds it in the checkout.
"""
from __future__ import annotations

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
