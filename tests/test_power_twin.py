"""Every board x layout the twin lays out is discovered completely, and `orin-agent power status --json`
shows the values that are in the tree (read back here straight from the twin's own file paths)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

twin = pytest.importorskip("power.twin")

from agent.cli import app  # noqa: E402
from power.runtime.board import open_board_at  # noqa: E402
from power.physics.boards import board_for  # noqa: E402
from power.hw.discovery import discover  # noqa: E402
from power_tree import snapshot  # noqa: E402

CASES = [(b, l4t) for b in sorted(twin.BOARDS) for l4t in ("r35", "r36")]


def _int(root: Path, rel: str) -> int:
    return int((root / rel).read_text().split()[0])


@pytest.mark.parametrize("board,l4t", CASES)
def test_twin_is_discovered_completely(tmp_path, board, l4t):
    twin.create_twin(tmp_path, board, l4t)
    spec = board_for(board, l4t)  # the Nano's r36 tree is the JetPack 6.2 "Super" one
    info = discover(tmp_path)
    assert info.unavailable == ()
    assert info.identity.board == board and info.identity.module == spec.module
    assert info.identity.l4t.layout == l4t
    assert tuple(c.cpus for c in info.cpu.clusters) == spec.cpu_clusters
    assert info.gpu.available_hz == spec.gpu_hz
    assert [r.label for r in info.rails] == [r.label for r in spec.rails if r.label != "NC"]
    assert len(info.zones) == 9 and {z.name for z in info.zones} >= {"cpu", "gpu", "tj"}
    assert open_board_at(tmp_path).nvpmodel.conf().default_id == spec.default_mode


@pytest.mark.parametrize("board,l4t", CASES)
def test_status_json_shows_the_tree(tmp_path, board, l4t):
    paths = twin.create_twin(tmp_path, board, l4t)
    sim = twin.Twin(tmp_path)
    sim.advance(20.0, twin.Workload("decode", gpu_util=0.6, mem_util=0.7))
    sim.flush()
    res = CliRunner().invoke(app, ["power", "status", "--root", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    root = tmp_path
    clocks = {c["name"]: c for c in doc["clocks"]}
    g = paths.gpu_devfreq
    assert (clocks["gpu"]["cur"], clocks["gpu"]["min"], clocks["gpu"]["max"]) == (
        _int(root, f"{g}/cur_freq"), _int(root, f"{g}/min_freq"), _int(root, f"{g}/max_freq"))
    assert clocks["emc"]["cur"] == _int(root, f"{paths.emc}/rate")
    for cluster in board_for(board, l4t).cpu_clusters:
        c = clocks[f"cpu{cluster[0]}-{cluster[-1]}"]
        pol = paths.policy(cluster[0])
        assert (c["unit"], c["min"], c["max"]) == ("kHz", _int(root, f"{pol}/scaling_min_freq"),
                                                    _int(root, f"{pol}/scaling_max_freq"))
    temps = [z["temp_c"] for z in doc["zones"]]
    for i, t in enumerate(temps):
        raw = _int(root, f"{paths.zone(i)}/temp")
        assert t == (None if raw <= -256000 else raw / 1000.0)
    rails = {r["label"]: r for r in doc["rails"]}
    for addr, hw in paths.ina:
        for ch in (1, 2, 3):
            label = (root / hw / f"in{ch}_label").read_text().strip()
            if label == "NC":
                assert label not in rails
                continue
            assert rails[label]["mv"] == _int(root, f"{hw}/in{ch}_input")
            assert rails[label]["ma"] == _int(root, f"{hw}/curr{ch}_input")
    assert doc["total_mw"] and doc["total_mw"] > 0
    assert doc["fan_pwm"] == _int(root, f"{paths.fan_hwmon}/pwm1")
    status_id = int((root / paths.nvpmodel_status).read_text().split("pmode:")[1][:4])
    assert doc["power_mode"]["id"] == status_id and doc["l4t_layout"] == l4t


@pytest.mark.parametrize("board,l4t", [("agx-orin-64gb", "r36"), ("orin-nano-8gb", "r35")])
def test_agent_writes_are_seen_by_the_twin_and_restored(tmp_path, board, l4t):
    twin.create_twin(tmp_path / "root", board, l4t)
    root = tmp_path / "root"
    before = snapshot(root)
    board_obj = open_board_at(root)
    w = board_obj.writer(tmp_path / "run")
    table = board_obj.info.gpu.available_hz
    board_obj.gpu.set_range(w, table[1], table[1])
    board_obj.set_mode(1, w)  # emulated nvpmodel: the mode's caps land in the tree's files
    sim = twin.Twin(root)
    lim = sim.read_limits()
    assert lim.gpu_max_hz == board_obj.gpu.read().max_hz
    assert sum(lim.cpu_online) == len(board_obj.nvpmodel.conf().mode(1).online_cores())
    w.journal.restore()
    assert snapshot(root) == before


def test_failed_twin_zone_is_offline(tmp_path):
    twin.create_twin(tmp_path, "agx-orin-64gb", "r36")
    sim = twin.Twin(tmp_path)
    sim.fail_zone("cv0")
    zones = {z["name"]: z for z in json.loads(CliRunner().invoke(
        app, ["power", "status", "--root", str(tmp_path), "--json"]).output)["zones"]}
    assert zones["cv0"]["temp_c"] is None and zones["tj"]["temp_c"] is not None
