"""`orin-agent power status|restore` on hand-made trees, and the jtop backend through a stand-in."""
from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from agent.cli import app
from power.hw.backends import JtopBoard, SysfsBoard
from power.hw.journal import JOURNAL_NAME
from power.runtime.status import read_status
from power_tree import make_tree, snapshot

runner = CliRunner()


def test_status_table_and_json(tmp_path):
    root = make_tree(tmp_path / "root", "r35")
    res = runner.invoke(app, ["power", "status", "--root", str(root)])
    assert res.exit_code == 0, res.output
    assert "p3701-0005" in res.output and "agx-orin-64gb" in res.output and "MODE_30W" in res.output
    assert "CPU-therm" in res.output and "VDD_GPU_SOC" in res.output
    doc = json.loads(runner.invoke(app, ["power", "status", "--root", str(root), "--json"]).output)
    assert doc["board"] == "agx-orin-64gb" and doc["fan_pwm"] == 77 and doc["unavailable"] == []


def test_watch_json_lines_ends_on_ctrl_c(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "root", "r36")
    calls = {"n": 0}

    def sleep(_s):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    res = runner.invoke(app, ["power", "status", "--root", str(root), "--json", "--watch", "--interval", "0.1"])
    assert res.exit_code == 0
    lines = [json.loads(x) for x in res.output.splitlines()]
    assert len(lines) == 2 and lines[0]["l4t_layout"] == "r36"


def test_bad_input_is_a_message_not_a_traceback(tmp_path):
    res = runner.invoke(app, ["power", "status", "--root", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such directory" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["power", "status", "--root", str(tmp_path), "--backend", "nvml"])
    assert res.exit_code == 2 and "unknown backend" in res.output
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / JOURNAL_NAME).write_text("{not json")
    res = runner.invoke(app, ["power", "restore", "--root", str(tmp_path), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2 and "not a readable journal" in res.output


def test_restore_command_puts_the_tree_back(tmp_path):
    root = make_tree(tmp_path / "root", "r36")
    run = tmp_path / "run"
    before = snapshot(root)
    board = SysfsBoard(root)
    w = board.writer(run)
    board.gpu.set_range(w, 612000000, 612000000)
    board.set_fan(255, w)
    w.journal.close()  # the agent exits (or dies) leaving its changes and the journal
    assert snapshot(root) != before
    res = runner.invoke(app, ["power", "restore", "--root", str(root), "--run-dir", str(run)])
    assert res.exit_code == 0 and "restored 3 file(s)" in res.output
    assert snapshot(root) == before
    res = runner.invoke(app, ["power", "restore", "--root", str(root), "--run-dir", str(run)])
    assert "nothing to restore" in res.output


class _Fan:
    speed = 40


class _Mode:
    id, name = 3, "MODE_50W"


class FakeJtop:
    """What jtop's public attributes look like (jetson-stats docs: power, temperature, fan, nvpmodel)."""

    def __init__(self) -> None:
        self.power = {"rail": {"VDD_GPU_SOC": {"online": True, "volt": 19000, "curr": 500, "power": 9500}},
                      "tot": {"power": 9500}}
        self.temperature = {"cpu": {"online": True, "temp": 51.5}, "cv0": {"online": False, "temp": -256}}
        self.fan = _Fan()
        self.nvpmodel = _Mode()
        self.jetson_clocks = False
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_jtop_backend_readings_and_setters(tmp_path):
    root = make_tree(tmp_path / "root", "r36")
    jet = FakeJtop()
    board = JtopBoard(jet, root)
    st = read_status(board)
    assert st.backend == "jtop" and st.power_mode.name == "MODE_50W"
    assert [r.label for r in st.rails] == ["VDD_GPU_SOC"] and st.total_mw == 9500.0
    zones = {z.name: z for z in st.zones}
    assert zones["cpu"].temp_c == 51.5 and zones["cv0"].temp_c is None
    assert zones["cpu"].trips  # trip points still come from sysfs
    assert st.fan_pwm == round(40 * 255 / 100)
    assert {c.name for c in st.clocks} >= {"gpu", "emc"}  # clocks stay on sysfs
    w = board.writer(tmp_path / "run")
    board.set_mode(1, w)
    board.set_fan(255, w)
    board.set_jetson_clocks(w)
    assert jet.nvpmodel == 1 and jet.fan.speed == 100 and jet.jetson_clocks is True
    assert any(e.path.endswith("pwm1") for e in w.journal.entries)  # restore puts the fan file back
    board.close()
    assert jet.closed


def test_status_shows_the_controller_state_until_restore(tmp_path):
    from power.twin import create_twin

    root, run = tmp_path / "twin", tmp_path / "run"
    create_twin(root, "agx-orin-64gb", "r36")
    args = ["--root", str(root), "--run-dir", str(run)]
    assert json.loads(runner.invoke(app, ["power", "status", *args, "--json"]).output)["controller"] is None
    assert runner.invoke(app, ["power", "set", "eco", *args]).exit_code == 0
    doc = json.loads(runner.invoke(app, ["power", "status", *args, "--json"]).output)
    assert doc["controller"]["profile"] == "eco" and doc["controller"]["phase"] == "idle"
    assert "profile eco, phase idle" in runner.invoke(app, ["power", "status", *args]).output
    assert runner.invoke(app, ["power", "restore", *args]).exit_code == 0
    assert json.loads(runner.invoke(app, ["power", "status", *args, "--json"]).output)["controller"] is None
