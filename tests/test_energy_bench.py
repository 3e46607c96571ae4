"""The energy benchmark's engine side and its twin fidelity: the service's Scheduler drives every policy
through the same tokens; a step's time follows the clocks that change within it (stock governors ramp up
during a prefill instead of running it all at the idle floor); jetson_clocks costs its captured idle
power (CPU idle states and GPU rail-gating off) and the journal puts it back; `twin predict` prints one
operating point."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from agent.benchmark.power_replay import run_power_bench
from agent.cli import app
from power.bench.energy import BenchConfig
from power.bench.run import PolicyRun
from power.runtime.board import open_board_at
from power.physics.boards import BOARDS
from power.physics.costmodel import OperatingPoint, prefill_step
from power.runtime.shapes import model_shape
from power.bench.traces import make_trace
from power.twin import IDLE, Twin, create_twin

SPEC = BOARDS["agx-orin-64gb"]


def test_scheduler_driver_gives_every_policy_the_same_tokens() -> None:
    cfg = BenchConfig(duration_s=120, policies=("maxn+jetson_clocks", "stock-maxn", "balanced"))
    res = run_power_bench(cfg)
    want = sum(r.output for r in make_trace("chat", 120, 0))
    assert {r.output_tokens for r in res} == {want}
    by = {r.policy: r for r in res}
    assert by["balanced"].idle_w < by["stock-maxn"].idle_w < by["maxn+jetson_clocks"].idle_w
    assert all(r.busy_joules_per_token > 0 and r.idle_s > 0 for r in res)


def test_stock_prefill_after_idle_ramps_within_the_step() -> None:
    """Under podgov a prefill after idle starts at the floor and ramps; integrated over the ramp it takes
    longer than at pinned clocks but far less than it would at the floor throughout."""
    shape = model_shape("llama-3-8b")
    top = prefill_step(SPEC, shape, "int4", OperatingPoint(SPEC.gpu_max_hz, SPEC.emc_max_hz, 8), 512).seconds
    floor = prefill_step(SPEC, shape, "int4", OperatingPoint(SPEC.gpu_hz[0], 2133000000, 8), 512).seconds
    with tempfile.TemporaryDirectory() as d:
        run = PolicyRun("agx-orin-64gb", "r36", "llama-3-8b", "int4", "stock-maxn", Path(d))
        try:
            run.idle_until(5.0)
            took = run.step("prefill", 512)
        finally:
            run.close()
    assert top < took < 0.5 * floor


def test_jetson_clocks_idle_costs_its_captured_power_and_restores(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    board = open_board_at(tmp_path)
    w = board.writer(tmp_path / "run" / "orin-agent")
    board.set_mode("MAXN", w)
    stock = Twin(tmp_path)
    stock.advance(5.0, IDLE)
    open_board_at(tmp_path).set_jetson_clocks(w)
    pinned = Twin(tmp_path)
    pinned.advance(5.0, IDLE)
    assert not pinned.limits.cpu_idle_states and not pinned.limits.railgate
    rails = dict(pinned.state.power.rails)
    assert abs(rails["VDD_GPU_SOC"] - 4.94) < 0.25 and abs(rails["VDD_CPU_CV"] - 0.988) < 0.1   # captured
    assert 7.1 <= stock.state.power.board_w <= 7.8                                               # captured
    w.journal.restore()
    assert Twin(tmp_path).limits.cpu_idle_states


def test_twin_predict_json_and_errors() -> None:
    r = CliRunner().invoke(app, ["twin", "predict", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["mode"] == "MAXN" and 30 < p["tokens_per_s"] < 40 and p["bound"] == "memory"
    assert abs(sum(p["rails_w"].values()) - p["board_w"]) < 1e-6
    r = CliRunner().invoke(app, ["twin", "predict", "--nvpmodel", "MODE_15W", "--json"])
    assert json.loads(r.stdout)["gpu_mhz"] == 420.75
    r = CliRunner().invoke(app, ["twin", "predict", "--phase", "nope"])
    assert r.exit_code == 2 and "decode, prefill" in r.output
