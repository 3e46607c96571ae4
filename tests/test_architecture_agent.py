"""The agent package's layering, checked: the engine's vocabulary and scheduler and the OpenAI wire
format load without torch, one generation path (no `Generation` class beside `EngineCore`), and no
module over 400 lines. Each import check runs in a fresh interpreter so sys.modules starts clean."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
MAX_LINES = 400


@pytest.mark.parametrize("module", ["agent.engine.types", "agent.engine.scheduler", "agent.api.openai"])
def test_module_loads_without_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_one_generation_path() -> None:
    # the same check as `grep -rqs '^class Generation\b' agent/`
    hits = [p for p in (REPO / "agent").rglob("*.py")
            if re.search(r"^class Generation\b", p.read_text(encoding="utf-8"), re.MULTILINE)]
    assert hits == []


def test_no_agent_module_over_the_line_limit() -> None:
    long = {str(p.relative_to(REPO)): n for p in (REPO / "agent").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
