"""Replays of the `auto` controller against boards whose step times and power differ from its cost model,
judged by the board's own truth: the settled point's true J/token within 3 % of the true optimum (least
J/token within the profile's latency slack over the truly fastest point) and its true step time within
that bound. Errors along each clock axis in both signs (a compute rate or a bandwidth efficiency that
depends on the clock; power off along either clock), decode at batch 1 and 8 and prefill, noise-free and
with +-5 % noise on every measured step time and power; a hypothesis property over random smooth boards
(derandomised: the same 40 boards each run), and two boards that property found where the controller missed
the optimum before its bisection rule (_FORMER_MISSES). Boards scaled by one factor
everywhere cannot move the optimum: they stay as a sanity case."""
from __future__ import annotations

import math
import random
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from power.physics.boards import BOARDS
from power.physics.costmodel import OperatingPoint, decode_step, prefill_step
from power.policy.autopoint import MAX_POINTS
from power.policy.dvfs import DvfsController, DvfsState, Planner, Readings, StepSample, tables_for
from power.policy.phase import PhaseEvent
from power.policy.profiles import ProfileStore
from power.runtime.shapes import model_shape

SPEC = BOARDS["agx-orin-64gb"]
PLANNER = Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0)
TABLES = tables_for(SPEC, 0)
PROFILE = ProfileStore(None).load("balanced")
G, E = SPEC.gpu_hz, SPEC.emc_hz
GTOP, ETOP = SPEC.gpu_max_hz, SPEC.emc_max_hz
Truth = Callable[[str, int, int, int, int], tuple[float, float]]    # (kind, size, batch, gpu, emc) -> (s, W)
Factor = Callable[[int, int], float]


def _one(g: int, e: int) -> float:
    return 1.0


def model(kind: str, size: int, batch: int, g: int, e: int) -> tuple[float, float]:
    s, j = PLANNER.predict(kind, size, batch, g, e)
    return s, j / s


def roofline(fc: Factor = _one, fm: Factor = _one, fp: Factor = _one, fo: float = 1.0) -> Truth:
    """A board whose compute time is the model's x fc, memory time x fm, overhead x fo (the step takes the
    larger of compute and memory, plus overhead, as on the model) and power x fp. A factor linear in its own
    clock keeps the time non-increasing in both clocks, as on any board."""
    memo: dict[tuple[object, ...], tuple[float, float]] = {}

    def truth(kind: str, size: int, batch: int, g: int, e: int) -> tuple[float, float]:
        key = (kind, size, batch, g, e)
        if key not in memo:
            op = OperatingPoint(g, e, PLANNER.tpcs)
            c = (prefill_step(SPEC, PLANNER.shape, "int4", op, size, 0) if kind == "prefill"
                 else decode_step(SPEC, PLANNER.shape, "int4", op, size, batch))
            t = max(c.compute_s * fc(g, e), c.memory_s * fm(g, e)) + c.overhead_s * fo
            memo[key] = (t, c.power_w * fp(g, e))
        return memo[key]
    return truth


def scaled(kt: float, kp: float = 1.0) -> Truth:
    return lambda kind, size, batch, g, e: (model(kind, size, batch, g, e)[0] * kt, model(kind, size, batch, g, e)[1] * kp)


def tilted(k: float) -> Truth:
    """Every step time off by up to ``k`` at the lowest GPU clock, exact at the top (k > 0: monotone)."""
    return lambda kind, size, batch, g, e: (model(kind, size, batch, g, e)[0] * (1 + k * (1 - g / GTOP)),
                                            model(kind, size, batch, g, e)[1])


def optimum(kind: str, size: int, batch: int, truth: Truth) -> tuple[tuple[int, int], dict, dict, float]:
    """Brute force over the grid with the board's true times and power."""
    tokens = size if kind == "prefill" else batch
    pts = {(g, e): truth(kind, size, batch, g, e) for g in G for e in E}
    times = {k: s for k, (s, _) in pts.items()}
    jpt = {k: s * w / tokens for k, (s, w) in pts.items()}
    slack = PROFILE.latency.ttft_slack if kind == "prefill" else PROFILE.latency.tpot_slack
    limit = min(times.values()) * (1 + slack)
    best = min((k for k in pts if times[k] <= limit * (1 + 1e-9)), key=lambda k: (jpt[k], times[k]))
    return best, jpt, times, limit


def replay(kind: str, size: int, batch: int, truth: Truth, steps: int, noise: float = 0.0,
           seed: int = 0) -> list[tuple[int, int]]:
    """The controller deciding every step; a step is measured (time and board power, each with +-noise)
    only when its clocks did not change at its start, as power.runtime.loop does."""
    rng = random.Random(seed)
    ctl = DvfsController(TABLES, PLANNER)
    phase = PhaseEvent("prefill", n_tokens=size) if kind == "prefill" else PhaseEvent("decode", context=size, batch=batch)
    s, sample, out, prev = DvfsState(), (), [], None
    for i in range(steps):
        d, s = ctl.decide(Readings(steps=sample), phase, PROFILE, s, 2.0 * i)   # past RECHECK_S: decides anew
        g, e = d.gpu_max_hz, d.emc_hz
        out.append((g, e))
        t, w = truth(kind, size, batch, g, e)
        t *= 1 + rng.uniform(-noise, noise)
        w *= 1 + rng.uniform(-noise, noise)
        sample = (StepSample(phase, g, e, t, w),) if (g, e) == prev else ()
        prev = (g, e)
    return out


def check(kind: str, size: int, batch: int, truth: Truth, noise: float = 0.0, seed: int = 0) -> None:
    steps = 1000 if noise else 200
    seen = replay(kind, size, batch, truth, steps, noise, seed)
    best, jpt, times, limit = optimum(kind, size, batch, truth)
    got = seen[-1]
    assert len(set(seen[-100:])) == 1, f"did not settle: {sorted(set(seen[-100:]))}"
    assert len(set(seen)) <= MAX_POINTS
    assert jpt[got] <= 1.03 * jpt[best], (f"settled at {got}, true J/token {jpt[got]:.4f}; optimum {best} "
                                          f"{jpt[best]:.4f}")
    # noise-free: within the bound; with +-5 % noise, within 1 % of it (what the means still carry)
    assert times[got] <= limit * (1.01 if noise else 1.001), f"settled at {got}: {times[got] / limit - 1:+.2%} past the bound"


def _lin(k: float, top: int, axis: int) -> Factor:
    return lambda g, e: 1 + k * (1 - (g, e)[axis] / top)


AXES = {"gpu": (GTOP, 0), "emc": (ETOP, 1)}
CASES = {**{f"compute {k:+.0%} at low GPU": roofline(fc=_lin(k, GTOP, 0)) for k in (0.3, -0.3)},
         **{f"bandwidth {k:+.0%} at low EMC": roofline(fm=_lin(k, ETOP, 1)) for k in (0.3, -0.3)},
         **{f"power {k:+.0%} at low {ax}": roofline(fp=_lin(k, *AXES[ax])) for k in (0.3, -0.3) for ax in AXES},
         "every step +30 % at low GPU": tilted(0.3),
         "exact": scaled(1.0)}
KINDS = [("decode", 600, 1), ("decode", 600, 8), ("prefill", 512, 1)]


@pytest.mark.parametrize("kind,size,batch", KINDS, ids=["decode b1", "decode b8", "prefill"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_settles_at_the_true_optimum(kind: str, size: int, batch: int, name: str) -> None:
    check(kind, size, batch, CASES[name])


@pytest.mark.parametrize("kind,size,batch", KINDS, ids=["decode b1", "decode b8", "prefill"])
@pytest.mark.parametrize("name", ["compute +30% at low GPU", "bandwidth -30% at low EMC", "power +30% at low gpu",
                                  "power -30% at low emc"])
def test_settles_at_the_true_optimum_with_noise(kind: str, size: int, batch: int, name: str) -> None:
    check(kind, size, batch, CASES[name], noise=0.05)


@pytest.mark.parametrize("k", [1.3, 0.7, 1.03])
def test_uniform_error_settles_at_the_model_optimum_with_noise(k: float) -> None:
    """The issue's case: +-5 % noise on a uniform error used to settle one step high (+3-4 % J/token)."""
    check("decode", 600, 1, scaled(k), noise=0.05)


# Two boards this property found on 2026-12-02 (one of three clean CI runs failed on a case like them; a search of
# 3000 random boards found these two): compute ~1.3-1.6x slower than the model and memory ~0.75x, so the step that
# the model calls memory-bound is near compute-bound. The controller used to measure the model's choice (624.75 MHz,
# 1.60x the TPOT limit), then the top GPU clock, and settle there (+10.9 % / +5.2 % J/token over the optimum within
# the bound, 930.75 / 1032.75 MHz): the fit through those two points called every clock between them too slow.
# autopoint's rule 5 (a bisection between a point found too slow and the choice, bounded by the board's
# monotonicity, not the fit) finds them now; kept as regular cases.
_FORMER_MISSES = [
    ([0.2832, 0.2398, 0.2566, -0.2548, 0.2183, 0.2219], [-0.2616, 0.2583, -0.0632, -0.1999, 0.2124, -0.0883], 0.9727),
    ([0.29, 0.2436, 0.1926, -0.2852, 0.2909, -0.2345], [0.0525, 0.2909, 0.0775, 0.134, -0.1565, -0.2994], 1.1161)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
          database=None)
@given(ct=st.lists(st.floats(-0.3, 0.3), min_size=6, max_size=6), cp=st.lists(st.floats(-0.3, 0.3), min_size=6, max_size=6),
       fo=st.floats(0.7, 1.5), which=st.sampled_from([("decode", 600, 1), ("decode", 600, 8), ("decode", 1500, 4),
                                                      ("prefill", 512, 1)]))
def test_random_smooth_boards(ct: list[float], cp: list[float], fo: float, which: tuple[str, int, int]) -> None:
    """Compute and bandwidth multipliers smooth in their own clock (up to e^+-0.6 over the table, the time
    staying non-increasing in both clocks), power smooth in both clocks, overhead 0.7-1.5x."""
    def u(g: int) -> float:
        return 1 - g / GTOP

    def w(e: int) -> float:
        return 1 - e / ETOP
    truth = roofline(fc=lambda g, e: math.exp(ct[0] + ct[1] * u(g) + ct[2] * u(g) ** 2),
                     fm=lambda g, e: math.exp(ct[3] + ct[4] * w(e) + ct[5] * w(e) ** 2),
                     fp=lambda g, e: math.exp(cp[0] + cp[1] * u(g) + cp[2] * w(e) + cp[3] * u(g) ** 2
                                              + cp[4] * u(g) * w(e) + cp[5] * w(e) ** 2), fo=fo)
    check(*which, truth)


@pytest.mark.parametrize("ct,cp,fo", _FORMER_MISSES)
def test_boards_the_controller_used_to_miss(ct: list[float], cp: list[float], fo: float) -> None:
    test_random_smooth_boards.hypothesis.inner_test(ct, cp, fo, ("decode", 600, 1))


@pytest.mark.parametrize("kind,size", [("decode", 600), ("prefill", 512)])
def test_model_20x_slow_everywhere_settles_on_the_model_optimum(kind: str, size: int) -> None:
    """The shipped model on a CPU, as far as its shape goes: every point ~20x the model's time."""
    seen = replay(kind, size, 1, scaled(20.0), 200)
    assert len(set(seen[-100:])) == 1 and seen[-1] == optimum(kind, size, 1, scaled(1.0))[0]


@pytest.mark.parametrize("noise", [0.0, 0.05])
@pytest.mark.parametrize("kind,size", [("decode", 600), ("prefill", 512)])
def test_flat_cpu_steps_settle(kind: str, size: int, noise: float) -> None:
    """The demo's case: a tiny model on a CPU, whose steps take the same time whatever the clocks (the CPU
    does not follow the twin's GPU clock): exploration stays within its budget and the clocks stop moving."""
    flat = 20 * model(kind, size, 1, GTOP, ETOP)[0]
    seen = replay(kind, size, 1, lambda *_: (flat, 10.0), 400, noise)
    assert len(set(seen)) <= MAX_POINTS and len(set(seen[-100:])) == 1


def test_measured_point_corrects_every_point() -> None:
    """One point measured 30 % slow: the correction reaches the points never measured too."""
    ctl = DvfsController(TABLES, PLANNER)
    p = PhaseEvent("decode", context=600)
    d, s = ctl.decide(Readings(), p, PROFILE, DvfsState(), 0.0)
    pred = PLANNER.predict("decode", 600, 1, d.gpu_max_hz, d.emc_hz)[0]
    _, s = ctl.decide(Readings(steps=(StepSample(p, d.gpu_max_hz, d.emc_hz, 1.3 * pred),)), p, PROFILE, s, 2.0)
    surf = s.learned.surface("decode", 1)
    for g, e in ((d.gpu_max_hz, d.emc_hz), (G[0], E[0]), (GTOP, ETOP)):
        got = surf.at(g, e, PLANNER.parts("decode", 608, 1, g, e)).log_time
        assert math.isclose(math.exp(got), 1.3, rel_tol=2e-3)


def test_a_well_measured_point_is_judged_by_its_own_spread() -> None:
    """A point measured many times with a tight spread has a small standard error even when the kind's
    other points (other batch classes, whose residuals vary with the rows served) are noisy: the noisy pool
    must not let the hysteresis keep it past the limit. Before OWN_NOISE_SAMPLES it takes the pool's."""
    from power.policy.learn import OWN_NOISE_SAMPLES, Residual

    r = Residual()
    for i in range(OWN_NOISE_SAMPLES - 1):
        r = r.add(0.02 + (1e-4 if i % 2 else -1e-4))
    pooled = 0.03 ** 2
    assert r.se(pooled) >= 0.03 / math.sqrt(OWN_NOISE_SAMPLES)
    r = r.add(0.02)
    assert r.se(pooled) < 1e-3
