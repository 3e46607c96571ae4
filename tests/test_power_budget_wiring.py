"""The power budget's wiring: the profiles' ``[budget]`` section (validated, errors naming file and key), the
``--power-cap`` override, the service's controller capped on a twin (state file, ``power status`` line,
``/metrics`` gauges) and ``power set --power-cap``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from power.policy.budget import BudgetController
from power.policy.profiles import Budget, ProfileError, ProfileStore
from power.runtime.cap import budget_for, with_cap
from power.runtime.shapes import model_shape


def store_with(tmp_path: Path, text: str) -> ProfileStore:
    (tmp_path / "capped.toml").write_text('include = "balanced"\n' + text)
    return ProfileStore(str(tmp_path))


def test_profile_budget_section(tmp_path: Path) -> None:
    p = store_with(tmp_path, "[budget]\nwatts = 15.0\npeak_watts = 40\n").load("capped")
    assert p.budget == Budget(15.0, 10.0, 40.0)
    assert ProfileStore(None).load("balanced").budget is None


@pytest.mark.parametrize("text, words", [
    ("[budget]\nwindow_s = 10\n", ["capped.toml", "[budget] lacks watts"]),
    ("[budget]\nwatts = 15\nwindow = 10\n", ["capped.toml", "unknown key 'window'", "window_s"]),
    ("[budget]\nwatts = -3\n", ["capped.toml", "budget.watts"]),
    ("[budget]\nwatts = 15\npeak_watts = 10\n", ["capped.toml", "budget.peak_watts"]),
    ("[budget]\nwatts = 15\nwindow_s = 0.2\n", ["capped.toml", "budget.window_s"]),
])
def test_profile_budget_errors_name_file_and_key(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(ProfileError) as e:
        store_with(tmp_path, text).load("capped")
    for w in words:
        assert w in str(e.value)


def test_power_cap_overrides_the_profile(tmp_path: Path) -> None:
    p = store_with(tmp_path, "[budget]\nwatts = 15.0\nwindow_s = 30\npeak_watts = 25\n").load("capped")
    assert budget_for(p, None) == Budget(15.0, 30.0, 25.0)
    assert budget_for(p, 20.0) == Budget(20.0, 30.0, 25.0)
    assert budget_for(p, 30.0) == Budget(30.0, 30.0, None)          # a peak below the new cap is dropped
    assert with_cap(ProfileStore(None).load("balanced"), 12.0).budget == Budget(12.0, 10.0, None)


def test_service_controller_capped_on_a_twin(tmp_path: Path) -> None:
    from agent.metrics import ServiceMetrics
    from power.runtime.controller import PowerController
    from power.policy.phase import PhaseEvent
    from power.runtime.state import describe_state
    from power.twin import create_twin

    root = tmp_path / "twin"
    create_twin(root, "agx-orin-64gb", "r36")
    ctl = PowerController.open(root, tmp_path / "run", "balanced", profile_dir=None, shape=model_shape("llama-3-8b"),
                               power_cap_w=15.0)
    try:
        assert isinstance(ctl.loop.controller, BudgetController)
        assert ctl.budget_status() is None                           # no decision yet
        ctl.loop.on_event(PhaseEvent("decode", context=600), 0.0)
        ctl.loop.on_event(PhaseEvent("decode", context=601), 0.5)
        st = ctl.budget_status()
        assert st is not None and st["watts"] == 15.0 and st["window_s"] == 10.0
        assert st["headroom_w"] == pytest.approx(15.0 - st["window_avg_w"])
        assert ctl.max_rows(8) == 8                                  # the budget is met: no admission limit
        snap = ctl.snapshot(ctl.loop.decision)
        assert "budget 15.0 W over 10.0 s: window average" in describe_state(snap)
        m = ServiceMetrics()
        m.watch_budget(ctl.budget_status)
        text = m.render().decode()
        for name in ("orin_agent_power_budget_watts 15.0", "orin_agent_power_window_average_watts",
                     "orin_agent_power_budget_headroom_watts", "orin_agent_power_budget_unmet 0.0"):
            assert name in text
    finally:
        ctl.applier.restore()
        ctl.applier.writer.journal.close()


def test_no_budget_no_gauges() -> None:
    from agent.metrics import ServiceMetrics

    m = ServiceMetrics()
    m.watch_budget(lambda: None)
    assert b"orin_agent_power_budget_watts" not in m.render()


def test_power_set_records_the_cap(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent.cli import app
    from power.twin import create_twin

    root = tmp_path / "twin"
    create_twin(root, "agx-orin-64gb", "r36")
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["power", "set", "balanced", "--root", str(root), "--run-dir", str(run),
                                 "--power-cap", "15"])
    assert r.exit_code == 0, r.output
    assert "power budget 15 W over 10 s" in r.output
    from power.runtime.state import STATE_FILE
    state = json.loads((run / STATE_FILE).read_text())
    assert state["budget"] == {"watts": 15.0, "window_s": 10.0}
    bad = CliRunner().invoke(app, ["power", "set", "balanced", "--root", str(root), "--run-dir", str(run),
                                   "--power-cap", "-1"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
