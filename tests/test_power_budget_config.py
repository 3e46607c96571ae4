"""What a power budget chooses beyond clocks: the nvpmodel mode and CPU cores online (the cost model's
time-shared hull; a TPC-mask change refused without --allow-reboot-modes; cores taken offline through the
journal and brought back by a restore), the budget on a named INA3221 rail, and the admission limit the
scheduler takes from it."""
from __future__ import annotations

from pathlib import Path

import pytest

from power.physics.boards import BOARDS, board_for
from power.physics.costmodel import OperatingPoint, decode_step
from power.runtime.shapes import model_shape
from power.policy.budget import Budget, BudgetController, BudgetState
from power.policy.dvfs import DvfsController, Planner, Readings, tables_for
from power.policy.phase import PhaseEvent
from power.policy.powerconfig import Mix, choose_config, hull_rate
from power.policy.profiles import ProfileError, ProfileStore

AGX = BOARDS["agx-orin-64gb"]
NANO = board_for("orin-nano-8gb", "r35")
SHAPE = model_shape("llama-3-8b")
BALANCED = ProfileStore(None).load("balanced")


def test_hull_time_shares_two_ways() -> None:
    ways = [(8.0, 10.0), (12.0, 30.0)]
    assert hull_rate(ways, 10.0) == pytest.approx(20.0)        # half the time at each
    assert hull_rate(ways, 7.0) == 0.0 and hull_rate(ways, 20.0) == 30.0


def test_tight_budget_picks_fewer_tpcs_loose_budget_maxn() -> None:
    tight = choose_config(AGX, SHAPE, "int4", 10.4)
    by = {o.mode: o for o in tight.options}
    # at 10.4 W four TPCs (MODE_30W) beat eight: MAXN's powered floor leaves less for speed
    assert tight.mode == "MODE_30W" and by["MODE_30W"].floor_w < by["MAXN"].floor_w
    assert tight.tokens_per_s == max(o.tokens_per_s for o in tight.options)
    loose = choose_config(AGX, SHAPE, "int4", 20.0)
    assert loose.mode == "MAXN" and loose.tokens_per_s > 2 * tight.tokens_per_s
    # a budget that binds keeps NVIDIA's fewest cores (4); one that does not, the mode's own
    assert tight.cores_online == 4
    assert choose_config(NANO, SHAPE, "int4", 15.0).cores_online == 6
    assert choose_config(NANO, SHAPE, "int4", 5.4).mode == "7W"
    assert choose_config(AGX, SHAPE, "int4", 10.4, modes=("MAXN",)).mode == "MAXN"


def test_fewer_cores_cost_less_in_the_cost_model() -> None:
    op = OperatingPoint(420750000, 2133000000, 8)
    full = decode_step(AGX, SHAPE, "int4", op, 1024, 8)
    four = decode_step(AGX, SHAPE, "int4", OperatingPoint(420750000, 2133000000, 8, cores_online=4), 1024, 8)
    assert four.seconds == full.seconds
    # 8 idle cores less: cpu_floor_w x 8 / 12 (boards.py, captured 0.4 W for 12 idle cores)
    assert full.power_w - four.power_w == pytest.approx(AGX.power.cpu_floor_w * 8 / 12)


def _twin(tmp_path: Path) -> Path:
    from power.twin import create_twin

    root = tmp_path / "twin"
    create_twin(root, "agx-orin-64gb", "r36")       # boots in MODE_30W (PM_CONFIG DEFAULT=2), 8 cores
    return root


def _online(root: Path) -> int:
    from power.hw.backends import open_board

    return sum(len(c.online) for c in open_board(root).cpu.read())


def test_session_refuses_a_reboot_mode_and_restore_brings_cores_back(tmp_path: Path) -> None:
    from power.runtime.session import open_session

    root = _twin(tmp_path)
    assert _online(root) == 8
    s = open_session(root, tmp_path / "run", BALANCED, model_shape("llama-3-8b"), power_cap_w=12.0, profile_dir=None)
    try:
        assert s.board.read_mode().name == "MODE_30W"       # MAXN would change the TPC mask: refused
        assert any("--allow-reboot-modes" in n and "MAXN" in n for n in s.warnings)
        assert any(n.startswith("power budget 12 W: MODE_30W with 4 CPU cores") for n in s.warnings)
        assert _online(root) == 4
    finally:
        s.applier.restore()
        s.writer.journal.close()
    assert _online(root) == 8                                  # power restore brings the cores back


def test_session_with_reboot_allowed_takes_the_chosen_mode(tmp_path: Path) -> None:
    from power.runtime.session import open_session

    root = _twin(tmp_path)
    s = open_session(root, tmp_path / "run", BALANCED, model_shape("llama-3-8b"), power_cap_w=15.0, profile_dir=None,
                     allow_reboot_modes=True)
    try:
        assert s.board.read_mode().name == "MAXN" and _online(root) == 4
        assert s.loop.controller.planner.tpcs == 8
    finally:
        s.applier.restore()
        s.writer.journal.close()
    assert _online(root) == 8


def test_power_restore_cli_brings_cores_back(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent.cli import app

    root, run = _twin(tmp_path), tmp_path / "run"
    r = CliRunner().invoke(app, ["power", "set", "balanced", "--root", str(root), "--run-dir", str(run),
                                 "--power-cap", "10"])
    assert r.exit_code == 0, r.output
    assert _online(root) == 4
    r = CliRunner().invoke(app, ["power", "restore", "--root", str(root), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    assert _online(root) == 8


def test_profile_rail_key(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('include = "balanced"\n[budget]\nwatts = 6\nrail = "VDD_GPU_SOC"\n')
    assert ProfileStore(str(tmp_path)).load("r").budget == Budget(6.0, 10.0, None, "VDD_GPU_SOC")
    (tmp_path / "bad.toml").write_text('include = "balanced"\n[budget]\nwatts = 6\nrail = 3\n')
    with pytest.raises(ProfileError, match="bad.toml.*rail"):
        ProfileStore(str(tmp_path)).load("bad")


def _rail_ctl(watts: float, rail: str | None) -> BudgetController:
    return BudgetController(DvfsController(tables_for(AGX, 0), Planner.for_board(AGX, model_shape("llama-3-8b"), "int4", 0)),
                            Budget(watts, 10.0, None, rail))


def test_rail_budget_predicts_the_rail_and_names_valid_rails() -> None:
    p = PhaseEvent("decode", context=1024, batch=8)
    board, gpu = _rail_ctl(6.0, None), _rail_ctl(6.0, "VDD_GPU_SOC")
    st = BudgetState()
    for (_, wb, g, e), (_, wr, g2, e2) in zip(board.points(p, st.dvfs), gpu.points(p, st.dvfs)):
        assert (g, e) == (g2, e2) and 0 < wr < wb - AGX.power.sys_w      # VIN_SYS_5V0 alone is 4.44 W
    with pytest.raises(ValueError, match="VDD_CPU_CV"):
        _rail_ctl(6.0, "VDD_IN")                                          # Orin NX/Nano's name, not AGX's


def test_rail_budget_in_a_closed_loop_holds_the_rail() -> None:
    c = _rail_ctl(6.0, "VDD_GPU_SOC")
    st, t = c.initial_state(), 0.0
    energy, p = 0.0, PhaseEvent("decode", context=1024, batch=8)
    reading = None
    while t < 60.0:
        d, st = c.decide(Readings(power_w=reading), p, BALANCED, st, t)
        reading = c.power_of("decode", 1024, 8, d.gpu_max_hz, d.emc_hz)    # the rail as the model has it
        energy += reading * 0.1
        t += 0.1
    assert energy / 60.0 <= 6.0 * 1.03
    assert d.emc_hz < AGX.emc_max_hz or d.gpu_max_hz < AGX.gpu_max_hz     # the cap binds


def test_admission_limit_only_when_the_floor_does_not_hold_the_window() -> None:
    c = _rail_ctl(5.0, None)                  # below any busy point's board power: unmet, and the rails say 9 W
    d, st = c.decide(Readings(power_w=9.0), PhaseEvent("decode", context=2048, batch=8), BALANCED,
                     c.initial_state(), 0.0)
    d, st = c.decide(Readings(power_w=9.0), PhaseEvent("decode", context=2049, batch=8), BALANCED, st, 1.0)
    assert st.status is not None and st.status.unmet
    assert c.max_rows(st, 8) == 1
    # unmet by the prediction, but the rails hold the window: no limit (fewer rows would only cost tokens/s)
    held = _rail_ctl(7.5, None)
    d, st3 = held.decide(Readings(power_w=7.0), PhaseEvent("decode", context=2048, batch=8), BALANCED,
                         held.initial_state(), 0.0)
    d, st3 = held.decide(Readings(power_w=7.0), PhaseEvent("decode", context=2049, batch=8), BALANCED, st3, 1.0)
    assert st3.status is not None and st3.status.unmet and held.max_rows(st3, 8) == 8
    ok = _rail_ctl(30.0, None)
    _, st2 = ok.decide(Readings(power_w=9.0), PhaseEvent("decode", context=2048, batch=8), BALANCED,
                       ok.initial_state(), 0.0)
    assert ok.max_rows(st2, 8) == 8


@pytest.mark.parametrize("paged", [False, True])
def test_scheduler_row_cap_limits_admission(paged: bool) -> None:
    from agent.engine.paged_scheduler import PagedScheduler
    from agent.engine.scheduler import Scheduler
    from agent.engine.types import INTERACTIVE, SamplingParams, SeqRequest

    s = (PagedScheduler(4, 64, 64, 4, frozenset(), max_queue=8) if paged
         else Scheduler(4, 64, frozenset(), max_queue=8))
    for i in range(4):
        s.add(SeqRequest(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=2, ignore_eos=True), INTERACTIVE))
    s.row_cap = 2
    s.schedule()
    assert s.num_running == 2 and s.num_waiting == 2
    s.row_cap = None
    s.schedule()
    assert s.num_running == 4


def test_capped_bench_rows_carry_mode_and_cores_and_a_rail() -> None:
    from power.bench.energy import BenchConfig, simple_driver
    from power.bench.budget import run_budget_bench

    cfg = BenchConfig(trace="batch", duration_s=20.0, profile_dir=None)
    rows = run_budget_bench(cfg, 15.0, simple_driver, iso_power=False)
    base, cap = rows
    assert (base["nvpmodel_mode"], base["cores_online"]) == ("MODE_15W", 4)
    assert (cap["nvpmodel_mode"], cap["cores_online"]) == ("MAXN", 4)
    assert cap["power_config"].startswith("power budget 15 W: MAXN")
    rows = run_budget_bench(cfg, 6.0, simple_driver, iso_power=False, rail="VDD_GPU_SOC")
    (cap,) = rows                                                    # no nvpmodel mode of 6 W
    assert cap["budget_rail"] == "VDD_GPU_SOC" and cap["max_window_avg_rail_control_w"] <= 6.0 * 1.03
    assert cap["mean_power_w"] > cap["mean_rail_w"] + AGX.power.sys_w   # the other rails are not budgeted
    with pytest.raises(ValueError, match="VDD_GPU_SOC"):
        run_budget_bench(cfg, 6.0, simple_driver, rail="VDD_IN")
