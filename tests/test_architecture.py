"""The layering rules of ``power``: it never imports ``agent``; ``power.physics`` and ``power.policy``
(shared by the controller and the twin) import nothing from ``power.twin``. Each import check runs in a
fresh interpreter so ``sys.modules`` holds only what the import pulled in; a static scan also catches
imports made inside functions."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    code = ("import importlib, pkgutil, sys\n"
            f"for name in {packages!r}:\n"
            "    pkg = importlib.import_module(name)\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
            "        importlib.import_module(m.name)\n"
            f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({forbidden!r}))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _imports(folder: Path) -> list[tuple[str, str]]:
    """(file, imported module) for every import statement under ``folder``, nested ones included."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(ROOT)), node.module))
    return found


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_physics_and_policy_load_nothing_from_the_twin_or_agent() -> None:
    assert _loaded_after(("power.physics", "power.policy"), ("power.twin", "agent")) == []


def test_power_loads_nothing_from_agent() -> None:
    assert _loaded_after(("power",), ("agent",)) == []


def test_no_import_statement_crosses_the_layers() -> None:
    bad = [(f, m) for f, m in _imports(ROOT / "power") if _is_under(m, "agent")]
    for layer in ("physics", "policy"):
        bad += [(f, m) for f, m in _imports(ROOT / "power" / layer) if _is_under(m, "power.twin")]
    assert bad == []


@pytest.mark.parametrize("module", ["power.runtime.session", "power.runtime.controller"])
def test_the_controller_does_not_load_the_twin_model(module: str) -> None:
    """The production controller runs without the simulator's model (only its tool runner, for twin
    roots, is loaded when such a root is opened)."""
    code = f"import sys, {module}; print([m for m in sys.modules if m.startswith('power.twin')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
