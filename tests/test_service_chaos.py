"""The chaos loop (scripts/chaos_test.py) as a test that stays: random SIGKILL / SIGTERM / SIGSTOP+SIGCONT
/ SIGSTOP+SIGKILL at random moments, start-up included, under concurrent streaming clients, restarted
on the same root. After every cycle, once recovery ran: no board file the agent may write differs from
the tree before the first start, no temp file is left, every request ended complete or with a clean
error (those cut by a SIGKILL while in flight are counted apart), none hung, and each start that
reached serving answered /health and one request. A CI-sized run in the default suite; >= 200 cycles
marked slow."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _chaos():  # noqa: ANN202 - the script's module
    spec = importlib.util.spec_from_file_location("chaos_test", REPO / "scripts" / "chaos_test.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _check(report: dict, cycles: int) -> None:
    summary = json.dumps({k: v for k, v in report.items() if k != "failures"})
    print(summary)  # the numbers docs/BENCHMARKS.md records (pytest -s, or -rA)
    assert report["failure_count"] == 0, "\n".join(report["failures"]) + "\n" + summary
    assert report["leaked_settings"] == report["other_files_changed"] == report["temp_files_left"] == 0
    assert report["hung"] == report["cut"] == report["bad_exits"] == report["health_failures"] == 0
    assert report["tracebacks_in_log"] == 0
    assert sum(report["actions"].values()) == cycles and all(report["actions"].values()), report["actions"]
    assert report["during_start_up"] > 0 and report["requests"] > cycles  # the chaos really happened
    assert report["kills_leaving_changes"] > 0  # ... and kills left clocks changed for the recovery to put back
    assert report["outcomes"].get("complete", 0) > 0


def test_chaos_ci_sized(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cycles = 8  # two blocks of the four actions (ACTIONS), each twice; >= 200 cycles: test_chaos_200_cycles
    report = _chaos().run_chaos(tiny_checkpoint, cycles, clients=(2, 4), seed=28, work=tmp_path / "chaos")
    _check(report, cycles)


@pytest.mark.slow
def test_chaos_200_cycles(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cycles = 200
    report = _chaos().run_chaos(tiny_checkpoint, cycles, clients=(4, 8), seed=2028, work=tmp_path / "chaos")
    _check(report, cycles)
