"""scripts/NAME.py as a module, for the tests of the scripts (they are files, not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as module `name` (kept in sys.modules: its dataclasses look themselves up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod = sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod
