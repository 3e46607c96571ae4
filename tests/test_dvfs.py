"""The pure DVFS + thermal controller: per-phase clocks, auto's shape (decode GPU-low/EMC-high,
prefill GPU-high/EMC-lower), online correction, idle hold, and hypothesis properties: never above
the profile's caps, critical always floors, no flapping on alternating inputs."""
from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from power.physics.boards import BOARDS
from power.policy.dvfs import Decision, DvfsController, DvfsState, Planner, Readings, StepSample, tables_for
from power.policy.phase import PhaseEvent
from power.policy.profiles import ProfileStore
from power.policy.thermal import ZoneSample
from power.runtime.shapes import model_shape

SPEC = BOARDS["agx-orin-64gb"]
STORE = ProfileStore(None)
CTL = DvfsController(tables_for(SPEC, 0), Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0))
PROFILES = {n: STORE.load(n) for n in STORE.names()}
ZONES_COOL = (ZoneSample("cpu", 50.0, 99.0), ZoneSample("gpu", 52.0, 99.0))


def run(events: list[tuple[PhaseEvent, float]], profile: str = "balanced", zones=None) -> list[Decision]:
    s, out = DvfsState(), []
    for p, now in events:
        d, s = CTL.decide(Readings(zones), p, PROFILES[profile], s, now)
        out.append(d)
    return out


def test_auto_decode_low_gpu_high_emc_prefill_high_gpu_lower_emc() -> None:
    pre, dec = run([(PhaseEvent("prefill", 512), 0.0), (PhaseEvent("decode", context=600), 1.0)])
    assert dec.gpu_max_hz < 0.6 * SPEC.gpu_max_hz and dec.emc_hz == SPEC.emc_max_hz
    assert pre.gpu_max_hz > 0.9 * SPEC.gpu_max_hz and pre.emc_hz < SPEC.emc_max_hz
    fastest = Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0).predict("decode", 608, 1, SPEC.gpu_max_hz,
                                                                       SPEC.emc_max_hz)[0]
    assert dec.predicted_s <= fastest * 1.04 + 1e-9


def test_idle_holds_then_floors_within_one_second() -> None:
    ds = run([(PhaseEvent("decode", context=100), 0.0), (PhaseEvent("idle"), 1.0), (PhaseEvent("idle"), 1.3),
              (PhaseEvent("idle"), 1.0 + PROFILES["balanced"].timing.idle_hold_s)])
    assert ds[1].phase == "idle-hold" and ds[1].clocks() == ds[0].clocks()
    assert ds[1].wake_at is not None and ds[1].wake_at - 1.0 < 1.0
    assert ds[3].phase == "idle" and ds[3].gpu_max_hz == SPEC.gpu_hz[0] and ds[3].emc_hz == SPEC.emc_hz[0]


def test_online_correction_moves_decode_off_a_slow_point() -> None:
    s = DvfsState()
    p = PROFILES["balanced"]
    d, s = CTL.decide(Readings(), PhaseEvent("decode", context=600), p, s, 0.0)
    slow_point = (d.gpu_max_hz, d.emc_hz)
    pred = d.predicted_s
    for i in range(20):     # this board runs that point 30 % slower than the model says
        sample = StepSample(PhaseEvent("decode", context=600), slow_point[0], slow_point[1], pred * 1.3)
        d, s = CTL.decide(Readings(steps=(sample,)), PhaseEvent("decode", context=600), p, s, 2.0 + i * 2)
    assert (d.gpu_max_hz, d.emc_hz) != slow_point
    assert abs(math.exp(s.learned.points[("decode", 1, *slow_point)].time.mean) - 1.3) < 0.01


def test_thermal_throttles_prefill_before_decode() -> None:
    hot = (ZoneSample("gpu", 93.0, 99.0),)      # above max's target (99 - 9 = 90), below critical
    s = DvfsState()
    p = PROFILES["max"]
    for i in range(3):
        dp, s = CTL.decide(Readings(hot), PhaseEvent("prefill", 256), p, s, float(i * 2))
    dd, s = CTL.decide(Readings(hot), PhaseEvent("decode", context=100), p, s, 7.0)
    assert dp.gpu_max_hz < SPEC.gpu_max_hz and dd.gpu_max_hz == SPEC.gpu_max_hz


def test_offline_zone_is_reported_not_cold() -> None:
    zones = (ZoneSample("gpu", None, 99.0), ZoneSample("cpu", None, 99.0))
    s = DvfsState()
    d, s = CTL.decide(Readings(zones), PhaseEvent("decode", context=100), PROFILES["balanced"], s, 0.0)
    assert d.message and "offline" in d.message and s.verdict.offline == ("gpu", "cpu")


phase_st = st.one_of(st.builds(PhaseEvent, st.just("prefill"), st.integers(1, 4096)),
                     st.builds(lambda c, b: PhaseEvent("decode", 0, c, b), st.integers(1, 4096), st.integers(1, 16)),
                     st.just(PhaseEvent("idle")))
temp_st = st.one_of(st.none(), st.floats(20, 110))


@settings(max_examples=60, deadline=None)
@given(profile=st.sampled_from(sorted(PROFILES)),
       seq=st.lists(st.tuples(phase_st, st.floats(0.001, 3.0), temp_st), min_size=1, max_size=40))
def test_never_above_caps_and_critical_floors(profile: str, seq: list) -> None:
    p = PROFILES[profile]
    caps = CTL.caps(p)
    busy_cap = tuple(max(caps[ph][i] for ph in ("prefill", "decode")) for i in range(3))
    s, now = DvfsState(), 0.0
    for phase, dt, temp in seq:
        now += dt
        zones = (ZoneSample("gpu", temp, 99.0),)
        d, s = CTL.decide(Readings(zones), phase, p, s, now)
        cap = caps["idle"] if d.phase == "idle" else busy_cap
        if d.phase in ("prefill", "decode") and s.mix_until <= now:
            cap = caps[d.phase]
        assert d.gpu_min_hz <= d.gpu_max_hz <= max(cap[0], caps["idle"][0])
        assert d.emc_hz <= max(cap[1], caps["idle"][1]) and d.cpu_max_khz <= max(cap[2], caps["idle"][2])
        if temp is not None and temp >= 99.0 - p.thermal.critical_margin_c:
            assert d.critical and d.clocks() == CTL.floor()


@settings(max_examples=40, deadline=None)
@given(gap=st.floats(0.005, 0.3), n=st.integers(6, 60), ctx=st.integers(10, 3000))
def test_no_flapping_on_alternating_decode_idle(gap: float, n: int, ctx: int) -> None:
    """Decode steps separated by short idle gaps (< idle_hold_s) never change the clocks."""
    events, now = [], 0.0
    for i in range(n):
        events.append((PhaseEvent("decode", context=ctx) if i % 2 == 0 else PhaseEvent("idle"), now))
        now += gap
    ds = run(events)
    assert len({d.clocks() for d in ds}) == 1


@settings(max_examples=40, deadline=None)
@given(base=st.floats(70, 95), n=st.integers(10, 80))
def test_thermal_no_flapping_on_alternating_temperatures(base: float, n: int) -> None:
    """Temperatures alternating inside the hysteresis band change the level at most once."""
    p = PROFILES["balanced"]
    target = 99.0 - p.thermal.target_margin_c
    s, levels = DvfsState(), []
    for i in range(n):
        t = target - 0.2 * p.thermal.hysteresis_c if i % 2 else target - 0.8 * p.thermal.hysteresis_c
        d, s = CTL.decide(Readings((ZoneSample("gpu", t + 0 * base, 99.0),)), PhaseEvent("decode", context=100),
                          p, s, float(i))
        levels.append(d.thermal_level)
    assert set(levels) == {0}


def test_a_prefill_inside_answers_is_held_to_the_tpot_slack() -> None:
    """A prefill that runs while rows are mid-answer (a decode step since the last idle) delays each of their
    next tokens by its whole length: its limit is the tighter TPOT slack; after an idle it is TTFT's again."""
    planner = CTL.planner
    top = planner.predict("prefill", 512, 1, SPEC.gpu_max_hz, SPEC.emc_max_hz)[0]
    lat = PROFILES["balanced"].latency
    assert lat.tpot_slack < lat.ttft_slack
    alone, = run([(PhaseEvent("prefill", 512), 0.0)])
    inside = run([(PhaseEvent("decode", context=600), 0.0), (PhaseEvent("prefill", 512), 0.05)])[1]
    after = run([(PhaseEvent("decode", context=600), 0.0), (PhaseEvent("idle"), 0.05),
                 (PhaseEvent("prefill", 512), 2.0)])[2]
    assert inside.predicted_s <= top * (1 + lat.tpot_slack) + 1e-9
    # the cheaper, slower point TTFT's slack allows is taken alone and after an idle, not inside answers
    assert top * (1 + lat.tpot_slack) < alone.predicted_s <= top * (1 + lat.ttft_slack) + 1e-9
    assert (after.gpu_max_hz, after.emc_hz) == (alone.gpu_max_hz, alone.emc_hz)
    assert (inside.gpu_max_hz, inside.emc_hz) != (alone.gpu_max_hz, alone.emc_hz)
