"""Where the project's own files live: the shipped model is the default of every command."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "stdlib-llama-8l"
