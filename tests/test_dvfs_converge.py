"""Replays of the `auto` controller against boards whose step times differ from the cost model: it
settles, on the model's optimum when the model is exact and within one table step of the corrected
optimum when the model is 3 %, 30 % or 20x off, without walking the GPU x EMC grid."""
from __future__ import annotations

import math
import random
from typing import Callable

import pytest

from power.physics.boards import BOARDS
from power.policy.dvfs import DvfsController, DvfsState, Planner, Readings, StepSample, tables_for
from power.policy.phase import PhaseEvent
from power.policy.profiles import ProfileStore
from power.runtime.shapes import model_shape

SPEC = BOARDS["agx-orin-64gb"]
PLANNER = Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0)
TABLES = tables_for(SPEC, 0)
PROFILE = ProfileStore(None).load("balanced")
Truth = Callable[[str, int, int, int], float]


def model_time(kind: str, size: int, g: int, e: int) -> float:
    return PLANNER.predict(kind, size, 1, g, e)[0]


def optimum(kind: str, size: int, truth: Truth) -> tuple[int, int]:
    """Brute force over the grid with the board's true times: least energy within the profile's slack."""
    pts = [(truth(kind, size, g, e), PLANNER.predict(kind, size, 1, g, e)[1] / model_time(kind, size, g, e)
            * truth(kind, size, g, e), g, e) for g in SPEC.gpu_hz for e in SPEC.emc_hz]
    slack = PROFILE.latency.ttft_slack if kind == "prefill" else PROFILE.latency.tpot_slack
    limit = min(p[0] for p in pts) * (1 + slack)
    best = min((p for p in pts if p[0] <= limit * (1 + 1e-9)), key=lambda p: (p[1], p[0]))
    return best[2], best[3]


def replay(kind: str, size: int, truth: Truth, steps: int = 40) -> list[tuple[int, int]]:
    ctl = DvfsController(TABLES, PLANNER)
    phase = PhaseEvent("prefill", n_tokens=size) if kind == "prefill" else PhaseEvent("decode", context=size)
    s, sample, out = DvfsState(), (), []
    for i in range(steps):
        d, s = ctl.decide(Readings(steps=sample), phase, PROFILE, s, 2.0 * i)   # past RECHECK_S: decides anew
        g, e = d.gpu_max_hz, d.emc_hz
        out.append((g, e))
        sample = (StepSample(phase, g, e, truth(kind, size, g, e)),)
    return out


def within_one_step(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return (abs(SPEC.gpu_hz.index(a[0]) - SPEC.gpu_hz.index(b[0])) <= 1
            and abs(SPEC.emc_hz.index(a[1]) - SPEC.emc_hz.index(b[1])) <= 1)


def scaled(k: float) -> Truth:
    return lambda kind, size, g, e: k * model_time(kind, size, g, e)


def tilted(k: float) -> Truth:
    """Off by up to ``k`` at the lowest GPU clock, exact at the top: the error depends on the clocks."""
    return lambda kind, size, g, e: (1 + k * (1 - g / SPEC.gpu_max_hz)) * model_time(kind, size, g, e)


@pytest.mark.parametrize("kind,size", [("decode", 600), ("prefill", 512)])
def test_exact_model_settles_at_the_model_optimum_at_once(kind: str, size: int) -> None:
    seen = replay(kind, size, scaled(1.0))
    assert set(seen) == {optimum(kind, size, scaled(1.0))}


@pytest.mark.parametrize("kind,size", [("decode", 600), ("decode", 2000), ("prefill", 512)])
@pytest.mark.parametrize("truth", [scaled(1.03), scaled(0.97), scaled(1.3), scaled(0.7), tilted(0.03),
                                   tilted(0.3)], ids=["+3%", "-3%", "+30%", "-30%", "tilt3%", "tilt30%"])
def test_model_off_settles_within_one_step_of_the_corrected_optimum(kind: str, size: int, truth: Truth) -> None:
    seen = replay(kind, size, truth)
    tail = seen[-15:]
    assert len(set(tail)) == 1, f"did not settle: {tail}"
    assert within_one_step(tail[0], optimum(kind, size, truth))
    assert len(set(seen)) <= 6          # the first point, a probe, at most four explorations


@pytest.mark.parametrize("kind,size", [("decode", 600), ("prefill", 512)])
def test_model_20x_fast_settles_without_a_walk(kind: str, size: int) -> None:
    """The shipped model on a CPU: every point really takes ~20x the model's time, whatever the
    clocks (the CPU does not follow the twin's GPU clock)."""
    flat = 20 * model_time(kind, size, SPEC.gpu_max_hz, SPEC.emc_max_hz)
    seen = replay(kind, size, lambda *_: flat)
    assert len(set(seen)) <= 2 and len(set(seen[2:])) == 1
    seen = replay(kind, size, scaled(20.0))     # one probe of the fastest point, then the optimum
    assert len(set(seen)) <= 2 and set(seen[2:]) == {optimum(kind, size, scaled(1.0))}


def test_noisy_cpu_steps_settle() -> None:
    """The demo's case: a tiny model on a loaded CPU, ~20x the model's time with +-5 % noise per step
    whatever the clocks: exploration stays within its budget and the clocks stop moving."""
    rng = random.Random(0)
    flat = 20 * model_time("decode", 600, SPEC.gpu_max_hz, SPEC.emc_max_hz)
    seen = replay("decode", 600, lambda *_: flat * (1 + rng.uniform(-0.05, 0.05)), steps=60)
    assert len(set(seen)) <= 6 and len(set(seen[-30:])) == 1


def test_measured_point_corrects_every_point() -> None:
    """One point measured 30 % slow: the correction reaches the points never measured too."""
    ctl = DvfsController(TABLES, PLANNER)
    p = PhaseEvent("decode", context=600)
    d, s = ctl.decide(Readings(), p, PROFILE, DvfsState(), 0.0)
    pred = model_time("decode", 608, d.gpu_max_hz, d.emc_hz)
    d2, s = ctl.decide(Readings(steps=(StepSample(p, d.gpu_max_hz, d.emc_hz, 1.3 * pred),)), p, PROFILE, s, 2.0)
    assert math.isclose(s.ratio("decode", d.gpu_max_hz, d.emc_hz), 1.3, rel_tol=1e-3)
    assert math.isclose(s.ratio("decode", SPEC.gpu_hz[0], SPEC.emc_hz[0]), 1.3, rel_tol=1e-3)
