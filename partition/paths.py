"""Where things live relative to the installed package: the shipped small model."""
from __future__ import annotations

from pathlib import Path

SHIPPED_MODEL_NAME = "stdlib-llama-8l"
# <repo>/models/stdlib-llama-8l, resolved from this file so it works from any working directory
# (the project is installed editable; the model folder is committed beside the packages).
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parents[1] / "models" / SHIPPED_MODEL_NAME
