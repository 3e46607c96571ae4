"""The power budget: the sliding-window accounting, the cap's window math, the budgeted controller in a closed
loop against a simulated rail (the window average holds, the rails' correction is learned, prefill borrows
from idle time), the floor case, thermal still overriding, and a short capped bench beside MODE_15W."""
from __future__ import annotations

import math

import pytest

from power.physics.boards import BOARDS
from power.policy.budget import (Budget, BudgetController, BudgetState, account, allowed_power,
                                 window_average, window_energy, window_pasts)
from power.policy.dvfs import DvfsController, Planner, Readings, tables_for
from power.policy.phase import PhaseEvent
from power.policy.profiles import ProfileStore
from power.policy.thermal import ZoneSample
from power.runtime.shapes import model_shape

SPEC = BOARDS["agx-orin-64gb"]
PLANNER = Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0)
BALANCED = ProfileStore(None).load("balanced")


def ctl(watts: float, window_s: float = 10.0) -> BudgetController:
    return BudgetController(DvfsController(tables_for(SPEC, 0), PLANNER), Budget(watts, window_s))


def steady(budget: Budget, watts: float, seconds: float, dt: float = 0.1, t0: float = 0.0) -> BudgetState:
    s = account(budget, BudgetState(), t0, watts)
    t = t0
    while t < t0 + seconds - 1e-9:
        t += dt
        s = account(budget, s, t, watts)
    return s


def test_window_accounting_keeps_one_window_and_averages_it() -> None:
    b = Budget(15.0, 10.0)
    s = steady(b, 12.0, 30.0)
    assert len(s.segments) == 1 and s.segments[0][0] == pytest.approx(20.0)     # one power: merged, older dropped
    assert window_average(b, s, 30.0) == pytest.approx(12.0, rel=1e-6)
    assert window_energy(b, s, 25.0, 30.0) == pytest.approx(60.0, rel=1e-6)
    s = account(b, s, 31.0, 22.0)                         # one second at 22 W
    assert window_average(b, s, 31.0) == pytest.approx(12.0 + 10.0 / 10, rel=1e-6)


def test_allowed_power_borrows_from_idle_and_reserves_the_floor() -> None:
    b = Budget(15.0, 10.0)
    idle = steady(b, 6.0, 10.0)
    full = steady(b, 15.0, 10.0)
    borrow = allowed_power(b, window_pasts(b, idle, 10.0), 1.0, 9.0)
    # the window ending 1 s ahead holds 9 s of idle (54 J) and the burst: (150 - 54) / 1 = 96 W; later windows
    # reserve 9 W for what follows the burst, and windows ending 10 s ahead hold no idle at all
    assert borrow == pytest.approx(min((150 - 6.0 * (10 - a) - max(0.0, a - 1.0) * 9.0) / min(1.0, a)
                                       for a in [k * 0.01 for k in range(1, 1001)]), rel=1e-6)
    assert borrow > 60.0
    # a window already at the budget allows no more than the budget itself (nothing to borrow)
    assert allowed_power(b, window_pasts(b, full, 10.0), 1.0, 9.0) == pytest.approx(15.0, rel=1e-6)


def test_budget_validation() -> None:
    with pytest.raises(ValueError, match="positive"):
        Budget(0.0)
    with pytest.raises(ValueError, match="at least 1 s"):
        Budget(15.0, 0.5)
    with pytest.raises(ValueError, match="peak_watts"):
        Budget(15.0, 10.0, 12.0)


Log = list[tuple[float, float]]


def simulate(c: BudgetController, seconds: float, rail_factor: float = 1.0,
             idle_until: float = 0.0) -> tuple[Log, list[int], BudgetState]:
    """Idle until ``idle_until``, then decode, against a rail that reads ``rail_factor`` x the model's power."""
    s, t, power = BudgetState(), 0.0, None
    log, tokens = [(0.0, 0.0)], []
    energy = 0.0
    while t < seconds:
        if t < idle_until:
            p = PhaseEvent("idle")
        else:
            p = PhaseEvent("decode", context=600, batch=1)
        d, s = c.decide(Readings(power_w=power), p, BALANCED, s, t)
        if p.kind == "idle":
            dt, w = 0.5, 6.5
        else:
            sec, j = PLANNER.predict(p.kind, p.n_tokens or p.context, p.batch, d.gpu_max_hz, d.emc_hz)
            dt, w = sec, j / sec * rail_factor
            tokens.append(d.gpu_max_hz)
        t += dt
        energy += w * dt
        power = w
        log.append((t, energy))
    return log, tokens, s


def max_window(log: list[tuple[float, float]], window_s: float) -> float:
    from power.bench.budget import max_window_average
    return max_window_average(log, window_s)


def test_closed_loop_holds_the_window_and_learns_the_rails() -> None:
    c = ctl(15.0)
    log, tokens, s = simulate(c, 60.0, rail_factor=1.2)    # the rails read 20 % above the model
    assert max_window(log, 10.0) <= 15.0 * 1.03
    assert s.power_log["decode"] == pytest.approx(math.log(1.2), abs=0.02)
    assert s.status is not None and not s.status.unmet
    # busy within the budget and well above the floor's speed: the cap is binding but used
    assert log[-1][1] / log[-1][0] > 15.0 * 0.9
    assert len(tokens) / 60.0 > 2 * 1 / PLANNER.predict("decode", 600, 1, SPEC.gpu_hz[0], SPEC.emc_hz[0])[0]


def test_prefill_borrows_from_idle_time() -> None:
    b15 = ctl(15.0)
    # after 10 s idle the prefill runs above the budget's wattage (borrowed), not capped to 15 W
    d, _ = b15.decide(Readings(power_w=6.5), PhaseEvent("prefill", n_tokens=1024), BALANCED,
                      simulate(b15, 10.0, idle_until=10.0)[2], 10.0)
    sec, j = PLANNER.predict("prefill", 1024, 1, d.gpu_max_hz, d.emc_hz)
    assert j / sec > 15.0


def test_floor_case_reports_and_serves_at_the_floor() -> None:
    c = ctl(5.0)                                            # below what any busy point draws
    s = BudgetState()
    d, s = c.decide(Readings(power_w=6.5), PhaseEvent("decode", context=600), BALANCED, s, 0.0)
    least = min(c.points(PhaseEvent("decode", context=600), s.dvfs), key=lambda p: p[1])
    assert (d.gpu_max_hz, d.emc_hz) == (least[2], least[3])
    assert d.message is not None and "cannot be met" in d.message
    assert s.status is not None and s.status.unmet and s.status.unmet_decisions == 1


def test_thermal_still_overrides() -> None:
    c = ctl(100.0)                                          # a budget that never binds
    crit = (ZoneSample("gpu", 98.5, 99.0),)                 # above critical (99 - 3)
    d, s = c.decide(Readings(crit, power_w=20.0), PhaseEvent("decode", context=600), BALANCED, BudgetState(), 0.0)
    assert d.critical and d.clocks() == c.floor()
    # a thermal cap (hot, not critical) is never raised by the budget
    hot = (ZoneSample("gpu", 93.0, 99.0),)
    mx = ProfileStore(None).load("max")
    s = BudgetState()
    plain_s = s.dvfs
    for i in range(3):
        d, s = c.decide(Readings(hot, power_w=20.0), PhaseEvent("prefill", 256), mx, s, float(2 * i))
        p, plain_s = c.dvfs.decide(Readings(hot), PhaseEvent("prefill", 256), mx, plain_s, float(2 * i))
        assert d.gpu_max_hz <= p.gpu_max_hz and d.emc_hz <= p.emc_hz
    assert d.gpu_max_hz < SPEC.gpu_max_hz


def test_capped_bench_beside_mode_15w() -> None:
    from power.bench.energy import BenchConfig, simple_driver
    from power.bench.budget import mode_for_cap, run_budget_bench

    assert mode_for_cap(SPEC, 15.0) == mode_for_cap(SPEC, 20.0) == "MODE_15W"
    assert mode_for_cap(SPEC, 30.0) == "MODE_30W" and mode_for_cap(SPEC, 10.0) is None
    rows = run_budget_bench(BenchConfig(trace="chat", duration_s=120.0, profile_dir=None), 15.0, simple_driver,
                            iso_power=False)
    assert [r["policy"] for r in rows] == ["stock-mode:MODE_15W", "cap-15W"]
    base, cap = rows
    assert "power_cap_w" not in base and cap["power_cap_w"] == 15.0
    assert cap["max_window_avg_control_w"] <= 15.0 * 1.03 and cap["max_window_avg_w"] <= 15.0 * 1.03
    assert cap["output_tokens"] == base["output_tokens"] > 0
    # the capped controller decodes faster per stream than MODE_15W (its own GPU/EMC caps)
    assert cap["vs_nvpmodel"]["decode_tok_s_per_stream_x"] > 1.3
