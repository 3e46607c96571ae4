"""The power budget prices power the way the equal-power ceiling does (power.policy.price): the hull's tie price,
the controller's points at that price against choose_config's own hull ways on the twin's grid, the time-share
and the 10 s windows in a closed loop over the ceiling's own mix (and over decode stretches of random length, on
every board), the guard's window bound exact over the measured segments, and a budget that does not bind leaving
the profile's points alone."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from power.physics.boards import BOARDS, board_for
from power.policy.budget import (Budget, BudgetController, BudgetState, account, allowed_power, correction,
                                 window_energy, window_pasts)
from power.policy.dvfs import DvfsController, Planner, Readings, tables_for
from power.policy.phase import PhaseEvent
from power.policy.powerconfig import Mix, choose_config, hull_rate, mode_ways
from power.policy.price import hull_price, price_cost, upper_hull
from power.policy.profiles import ProfileStore
from power.runtime.shapes import model_shape

SHAPE = model_shape("llama-3-8b")
BALANCED = ProfileStore(None).load("balanced")
MIX = Mix()
CTX = MIX.prompt + MIX.output // 2                      # the ceiling's decode context (powerconfig._points)


def test_hull_price_ties_the_two_ways_around_the_budget() -> None:
    ways = [(8.0, 10.0), (12.0, 30.0), (20.0, 40.0), (9.0, 11.0)]      # (9, 11) is under the hull
    assert upper_hull(ways) == [(8.0, 10.0), (12.0, 30.0), (20.0, 40.0)]
    lam = hull_price(ways, 10.0)
    assert lam == pytest.approx(0.25)          # 30 (1 - 2 lam) = 10 (1 + 2 lam)
    per_token = [(1 + lam * (p - 10.0)) / r for p, r in ways[:2]]
    assert per_token[0] == pytest.approx(per_token[1])
    assert hull_price(ways, 20.0) == 0.0 and hull_price(ways, 25.0) == 0.0     # the fastest way fits
    assert hull_price(ways, 15.0) > 0 and price_cost(1.0, 12.0, 10.0, 0.25) == pytest.approx(1.5)


def _ctl(board: str, l4t: str, mode: str, watts: float, cores: int) -> BudgetController:
    spec = board_for(board, l4t)
    mid = next(m.id for m in spec.modes if m.name == mode)
    return BudgetController(DvfsController(tables_for(spec, mid), Planner.for_board(spec, SHAPE, "int4", mid)),
                            Budget(watts, 10.0), MIX, cores)


CASES = [("agx-orin-64gb", "r36", 10.5), ("agx-orin-64gb", "r36", 14.1), ("orin-nano-8gb", "r35", 5.4)]


def _way(c: BudgetController, lam: float) -> tuple[tuple[float, float], tuple[int, int], tuple[int, int]]:
    """The (W, tok/s) of serving the mix at the controller's own choices at price ``lam``, and the two points."""
    st = BudgetState()
    pre = c.ranked(c.points(PhaseEvent("prefill", n_tokens=512), st.dvfs), 1.0, lam)[0]
    dec = c.ranked(c.points(PhaseEvent("decode", context=CTX, batch=MIX.batch), st.dvfs), 1.0, lam)[0]
    per_out = MIX.prompt / MIX.output
    tp, td = pre[0] / 512, dec[0] / MIX.batch                  # seconds per prefill token / per output token
    t = per_out * tp + td
    return ((per_out * tp * pre[1] + td * dec[1]) / t, 1 / t), (pre[2], pre[3]), (dec[2], dec[3])


def _hull_points(spec, mode, cores: int) -> dict[tuple[float, float], tuple[tuple[int, int], tuple[int, int]]]:
    """Each way of choose_config's hull in ``mode``: its (prefill point, decode point) of the grid."""
    from power.physics.boards import active_tpcs
    from power.policy.powerconfig import grid_points

    gpus = [g for g in spec.gpu_hz if g <= (mode.gpu_max_hz or spec.gpu_max_hz)]
    emcs = [e for e in spec.emc_hz if e <= (mode.emc_cap_hz or spec.emc_max_hz)]
    keys = [(g, e) for g in gpus for e in emcs]
    pre, dec = grid_points(spec, SHAPE, "int4", active_tpcs(spec, mode.tpc_pg_mask), gpus, emcs, cores, MIX)
    per_out = MIX.prompt / MIX.output
    hull = upper_hull(mode_ways(spec, SHAPE, "int4", mode, cores, MIX))
    out = {}
    for kp, (pp, tp) in zip(keys, pre):
        for kd, (pd, td) in zip(keys, dec):
            t = per_out * tp + td
            way = ((per_out * tp * pp + td * pd) / t, 1 / t)
            for h in hull:
                if abs(h[0] - way[0]) < 1e-9 and abs(h[1] - way[1]) < 1e-9:
                    out[h] = (kp, kd)
    assert set(out) == set(hull)
    return out


@pytest.mark.parametrize("board,l4t,watts", CASES)
def test_controller_picks_the_ceilings_hull_points(board: str, l4t: str, watts: float) -> None:
    spec = board_for(board, l4t)
    choice = choose_config(spec, SHAPE, "int4", watts)
    mode = next(m for m in spec.modes if m.name == choice.mode)
    hull = upper_hull(mode_ways(spec, SHAPE, "int4", mode, choice.cores_online, MIX))
    assert hull_rate(hull, watts) == pytest.approx(choice.tokens_per_s)        # the ceiling is this hull at W
    c = _ctl(board, l4t, choice.mode, watts, choice.cores_online)
    assert c.hull_price == pytest.approx(hull_price(hull, watts))
    points = _hull_points(spec, mode, choice.cores_online)
    lo = max(w for w in hull if w[0] <= watts)
    hi = min(w for w in hull if w[0] > watts)
    # a hair above the tie the controller's prefill and decode points are those of the hull's way below the
    # budget, a hair below it those of the way above: the ceiling's own operating points, no other (the
    # controller's decode step is the planner's, whose context bucket makes it 0.1-0.5 % longer than the
    # ceiling's, so the (W, tok/s) agree to 0.5 %, the points exactly)
    below, *pd_lo = _way(c, c.hull_price * 1.001)
    above, *pd_hi = _way(c, c.hull_price * 0.999)
    assert tuple(pd_lo) == points[lo] and tuple(pd_hi) == points[hi]
    assert below == pytest.approx(lo, rel=5e-3) and above == pytest.approx(hi, rel=5e-3)


def test_closed_loop_on_the_mix_time_shares_to_the_ceiling_and_holds_the_windows() -> None:
    """Prefill chunks and decode steps in the mix's proportion (one 512-token chunk per 16 steps of 8 rows:
    4 prompt tokens per output token), against rails that read the model's power: the controller's tok/s
    against choose_config's, its windows, and its prefill at the hull's two prefill points."""
    from power.bench.budget import max_window_average

    watts = 10.5
    spec = BOARDS["agx-orin-64gb"]
    choice = choose_config(spec, SHAPE, "int4", watts)
    c = _ctl("agx-orin-64gb", "r36", choice.mode, watts, choice.cores_online)
    *_, pre_lo, dec_lo = _way(c, c.hull_price * 1.001)
    *_, pre_hi, dec_hi = _way(c, c.hull_price * 0.999)
    assert dec_lo == dec_hi                     # at 10.5 W the two hull ways share the decode point
    st, t, power, energy, tokens = BudgetState(), 0.0, None, 0.0, 0
    log, pre_s = [(0.0, 0.0)], {pre_lo: 0.0, pre_hi: 0.0, "other": 0.0}
    steps = [PhaseEvent("prefill", n_tokens=512)] + [PhaseEvent("decode", context=CTX, batch=8)] * 16
    i = 0
    while t < 240.0:
        p = steps[i % len(steps)]
        i += 1
        d, st = c.decide(Readings(power_w=power), p, BALANCED, st, t)
        sec, _ = c.planner.predict(p.kind, p.n_tokens or p.context, p.batch, d.gpu_max_hz, d.emc_hz)
        power = c.power_of(p.kind, p.n_tokens or p.context, p.batch, d.gpu_max_hz, d.emc_hz)
        if p.kind == "prefill":
            key = (d.gpu_max_hz, d.emc_hz)
            pre_s[key if key in pre_s else "other"] += sec
        else:
            tokens += p.batch
        t += sec
        energy += power * sec
        log.append((t, energy))
    # the ceiling's time-share is not reachable under 10 s windows even on its own mix: one decode stretch of
    # 0.6 s at 18 W per 2.9 s cycle does not divide the window, so windows holding one cycle more of decode
    # than the average go over (measured: 10.8 W at the ceiling's own points); the guard vetoes those steps
    # (docs/BENCHMARKS.md, the power budget); 90.4 % of the ceiling measured here
    assert tokens / t >= 0.89 * choice.tokens_per_s
    # the rails read the model's power, so the guard's bound is exact: no 10 s window over the budget (with
    # slots counted pro rata and windows checked every 0.25 s only: 10.56 W)
    assert energy / t <= watts and max_window_average(log, 10.0) <= watts * (1 + 1e-9)
    total = sum(pre_s.values())
    # prefill runs at the hull's two prefill points; the rest (10.9 % measured; 2.3 % while the guard missed
    # windows) at their neighbours, where the guard vetoed the priced decode point and the window's headroom then
    # lowered the price
    assert pre_s["other"] <= 0.15 * total


def test_a_budget_that_does_not_bind_keeps_the_profiles_points() -> None:
    spec = BOARDS["agx-orin-64gb"]
    loose = BudgetController(DvfsController(tables_for(spec, 0), Planner.for_board(spec, SHAPE, "int4", 0)),
                             Budget(80.0, 10.0), MIX, None)
    plain = loose.dvfs
    st, ps, t = BudgetState(), BudgetState().dvfs, 0.0
    for p in [PhaseEvent("prefill", n_tokens=512), PhaseEvent("decode", context=CTX, batch=8)] * 5:
        d, st = loose.decide(Readings(power_w=20.0), p, BALANCED, st, t)
        q, ps = plain.decide(Readings(power_w=20.0), p, BALANCED, ps, t)
        assert (d.gpu_max_hz, d.emc_hz) == (q.gpu_max_hz, q.emc_hz)
        t += 0.5


def test_window_energy_counts_what_was_measured_up_to_the_last_reading() -> None:
    """The joules up to the last reading are all in the window (spread over a slot's whole width, as slots
    once did, the trailing window read up to one slot short, and the guard let windows run ~1 % over)."""
    b = Budget(10.0, 10.0)                                  # slots of 0.25 s
    s = account(b, account(b, BudgetState(), 0.0, 20.0), 0.1, 20.0)
    assert window_energy(b, s, -9.9, 0.1) == pytest.approx(2.0)      # 0.1 s at 20 W, all inside the window
    s = account(b, s, 0.5, 20.0)
    assert window_energy(b, s, 0.25, 0.5) == pytest.approx(5.0) and window_energy(b, s, 0.0, 0.5) == pytest.approx(10.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_guards_bound_is_exact_over_every_window_ahead(seed: int) -> None:
    """At the power allowed_power returns, no window ending within a window from now goes over the budget
    (checked on a 1 ms grid of window ends and at every segment boundary), and a hair more power puts one over:
    the bound is neither loose nor short. Slots counted pro rata with window ends checked every 0.25 s missed
    windows ending between those ends, and the oldest slot's joules (Orin Nano 5.4 W: 10 s windows at 5.43 W)."""
    b, rng = Budget(5.4, 10.0), random.Random(seed)
    st, t = BudgetState(), 0.0
    while t < 30.0:                 # readings at irregular times, powers around the budget
        t += rng.uniform(0.02, 0.6)
        st = account(b, st, t, rng.choice([3.4, 4.2, 5.0, 7.0, 7.8]))
    now = t
    scale = min(1.0, 0.98 * b.watts * b.window_s / window_energy(b, st, now - b.window_s, now))
    st = replace(st, segments=tuple((t0, t1, w * scale) for t0, t1, w in st.segments))   # the window ending now fits
    ends = sorted({k * 1e-3 for k in range(1, 10_001)} | {a for a, _ in window_pasts(b, st, now) if a > 0})
    for horizon, reserve in ((0.1, 3.0), (0.7, 3.0), (2.5, 4.5)):
        allowed = allowed_power(b, window_pasts(b, st, now), horizon, reserve)

        def worst(p: float) -> float:
            return max(window_energy(b, st, now + a - b.window_s, now) + p * min(a, horizon)
                       + reserve * max(0.0, a - horizon) for a in ends + [horizon])
        assert worst(allowed) <= b.watts * b.window_s + 1e-9
        assert worst(allowed + 1e-3) > b.watts * b.window_s


def _loop(board: str, l4t: str, watts: float, seconds: float, seed: int) -> tuple[float, float, float]:
    """One 512-token prefill chunk, then a decode stretch of 2-48 steps of 8 rows (random), against rails that read
    the model's power: (share of choose_config's tok/s, mean W, largest 10 s window average W)."""
    from power.bench.budget import max_window_average

    choice = choose_config(board_for(board, l4t), SHAPE, "int4", watts)
    c = _ctl(board, l4t, choice.mode, watts, choice.cores_online)
    rng = random.Random(seed)
    st, t, power, energy, tokens, log = BudgetState(), 0.0, None, 0.0, 0, [(0.0, 0.0)]
    while t < seconds:
        for p in [PhaseEvent("prefill", n_tokens=512)] + [PhaseEvent("decode", context=CTX, batch=8)] * rng.choice(
                [2, 4, 8, 16, 32, 48]):
            d, st = c.decide(Readings(power_w=power), p, BALANCED, st, t)
            sec, _ = c.planner.predict(p.kind, p.n_tokens or p.context, p.batch, d.gpu_max_hz, d.emc_hz)
            power = c.power_of(p.kind, p.n_tokens or p.context, p.batch, d.gpu_max_hz, d.emc_hz)
            tokens += p.batch if p.kind == "decode" else 0
            t += sec
            energy += power * sec
            log.append((t, energy))
    return tokens / t / choice.tokens_per_s, energy / t, max_window_average(log, 10.0)


@pytest.mark.parametrize("board,l4t,watts,share", [("agx-orin-64gb", "r36", 10.5, 0.90),
                                                   ("agx-orin-64gb", "r36", 14.1, 0.97),
                                                   ("orin-nano-8gb", "r35", 5.4, 0.82)])
def test_closed_loop_holds_every_10s_window_on_every_board(board: str, l4t: str, watts: float, share: float) -> None:
    """Decode stretches of random length between prefill chunks (the trace's, not the ceiling's even mix): with
    the model's power on the rails no 10 s window goes over the budget on any of the three rows. Before the
    exact accounting: 10.54 / 14.14 / 5.41 W (+0.4 / +0.3 / +0.1 %). Measured shares 0.919 / 0.991 / 0.845."""
    got, mean, worst = _loop(board, l4t, watts, 240.0, 1)
    assert worst <= watts * (1 + 1e-9) and mean <= watts
    assert got >= share


def test_the_power_correction_is_each_points_own_where_it_ran() -> None:
    """Rails that read the model's power at one decode point and 3 % over it at another: each point's correction
    is its own, a point never run gets the kind's (between the two). One EWMA per kind, learned mostly at the
    low point, put the high one 2.4-2.8 % under the rails on Orin Nano at 5.4 W, in the last step of every 10 s
    window that went over."""
    b, st, t = Budget(5.4, 10.0), BudgetState(), 0.0
    lo, hi = (300_000_000, 2_133_000_000), (600_000_000, 3_199_000_000)
    for k in range(60):
        g, e = hi if k % 4 == 3 else lo
        factor = 1.03 if (g, e) == hi else 1.0
        st = account(b, replace(st, running=("decode", 5.0, g, e)), t, 5.0 * factor)
        t += 0.3
    st = account(b, replace(st, running=("decode", 5.0, *lo)), t, 5.0)
    assert correction(st, "decode", *lo) == pytest.approx(1.0, abs=1e-9)
    assert correction(st, "decode", *hi) == pytest.approx(1.03, rel=1e-6)
    assert 1.0 < correction(st, "decode", 400_000_000, 3_199_000_000) < 1.03
    assert correction(st, "prefill", *lo) == 1.0                  # nothing learned for the kind yet
