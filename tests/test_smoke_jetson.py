"""The smoke checks on a real Jetson Orin (root /): the same checks `orin-agent smoke` runs, as tests.
Marked `jetson`: skipped elsewhere with the reason (tests/conftest.py). Run them as root on the board,
with the service stopped (the clock round trips need the board to themselves)."""
from __future__ import annotations

import pytest

from agent.config import load_config
from agent.smoke import CHECKS, SmokeOptions, SmokeReport, default_run_dir, run_smoke

pytestmark = pytest.mark.jetson


@pytest.fixture(scope="module")
def report() -> SmokeReport:
    cfg = load_config(None)
    return run_smoke(SmokeOptions("/", default_run_dir("/"), cfg, service_url=f"http://127.0.0.1:{cfg.port}"))


@pytest.mark.parametrize("name", [c.name for c in CHECKS])
def test_check_does_not_fail_on_the_board(report: SmokeReport, name: str) -> None:
    r = report.result(name)
    if r.status == "skip":
        pytest.skip(f"{name}: {r.detail}")
    assert r.status == "pass", f"{r.detail} -- fix: {r.remedy}"


def test_board_is_an_orin_with_cuda_torch(report: SmokeReport) -> None:
    assert report.result("board").data["model"] and not report.twin
    assert report.result("versions").data["cuda_available"] is True
