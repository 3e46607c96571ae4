"""Phase-aware DVFS: the pure controller ``decide(readings, phase, profile, state, now)``.

The policy (``power.runtime.applier`` does the writing). Per phase it turns the
profile's clock policy into concrete clocks from the board's tables:
- fixed values (fractions, frequencies) are snapped to the table and capped by the power mode;
- ``auto`` picks the (GPU, EMC) point of least joules per token whose step time is within the profile's
  latency targets (slack over the fastest allowed point, and/or an absolute TTFT/TPOT), starting from the
  roofline cost model (``power.physics.costmodel``) and correcting it online from what the board measures
  (RESEARCH.md: a GPU-clock-only latency model misses by up to 32 % on Orin, so learn per clock point):
  each measured step's time and, where the rails are read, its power, against the model's at the size
  actually served (``power.policy.learn``: per point residuals; at the points not measured a roofline of
  compute / memory / overhead multipliers and a plane over both clocks, per decode batch class). The
  choice, the probe of the top clocks, the explorations and the verifications are
  ``power.policy.autopoint``'s. A model off by the same factor everywhere (the shipped model on a CPU:
  20x) changes no choice. Decode comes out GPU-low/EMC-high, prefill GPU-high/EMC-lower, because that is
  what the model (and the board) rewards. A prefill that runs while rows are mid-answer (a decode step
  since the last idle) is held to the TPOT slack as well as TTFT's: it delays each of their next tokens.
- idle drops to the idle policy after ``idle_hold_s`` (< 1 s); shorter idle gaps keep the busy
  clocks (no churn between decode steps), busy phases alternating faster than ``dwell_s`` run at the
  element-wise maximum of both phases' clocks;
- the thermal controller (``power.policy.thermal``) lowers caps (prefill first, then decode) and at
  critical sends every clock to the board's floor.

No I/O and no clock reads: readings, the phase and ``now`` come in; a decision and the new state go
out. The cost model is consulted through :class:`Planner` (pure, memoised per instance).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from power.physics.boards import BoardSpec, active_tpcs
from power.physics.costmodel import CostParams, DEFAULT_PARAMS, ModelShape, OperatingPoint, decode_step, prefill_step
from power.hw.tables import BoardTables, snap
from power.policy.autopoint import choose, corrected
from power.policy.learn import Learned, batch_class
from power.policy.phase import PhaseEvent
from power.policy.profiles import Profile, resolve_clock
from power.policy.thermal import ThermalState, ThermalVerdict, ZoneSample, thermal_step

# a new clock takes effect in ~1 / 5 / 8 ms (CPU / GPU / EMC; ../shared/ORIN.md, an Orin NX/Nano measurement):
# a step that began with a switch is measured only when it lasted 25x the slowest (the settle <= 4 % of it)
SWITCHED_MIN_S = 25 * 0.008
RECHECK_S = 1.0             # re-decide at least this often while a phase persists (thermal, corrections)
PREFILL_ONLY_LEVELS = 4     # thermal levels that cap prefill alone before decode's cap starts falling


@dataclass(frozen=True)
class StepSample:
    """One measured step: what ran, at which clocks, how long it took and the board power the rails read
    while it ran (None: not read)."""
    phase: PhaseEvent
    gpu_hz: int
    emc_hz: int
    seconds: float
    watts: float | None = None


@dataclass(frozen=True)
class Readings:
    """What the sensors said since the last call. ``zones`` None = not sampled this time (the thermal
    state holds); an empty or all-offline tuple is reported as such."""
    zones: tuple[ZoneSample, ...] | None = None
    fan_ours: bool = False
    steps: tuple[StepSample, ...] = ()
    power_w: float | None = None        # board power of the interval that just ended (rails; a budget's input)


@dataclass(frozen=True)
class Decision:
    phase: str                  # the phase the clocks are for ("decode", "idle-hold", "critical", ...)
    gpu_min_hz: int
    gpu_max_hz: int
    emc_hz: int
    cpu_max_khz: int
    fan_pwm: int | None
    thermal_level: int
    critical: bool
    reason: str
    wake_at: float | None = None            # call again at this time even without an event
    predicted_s: float | None = None        # predicted step time at these clocks (auto)
    message: str | None = None              # for the log (critical, offline zones)
    learning: bool = False                  # auto's probe or exploration: measure it, then decide anew

    def clocks(self) -> tuple[int, int, int, int]:
        return self.gpu_min_hz, self.gpu_max_hz, self.emc_hz, self.cpu_max_khz


@dataclass(frozen=True)
class DvfsState:
    last: Decision | None = None
    last_key: tuple[object, ...] | None = None
    decided_s: float = float("-inf")
    busy: Decision | None = None            # the clocks of the last busy phase
    other: Decision | None = None           # the busy phase before it (for dwell mixing)
    switched_s: float = float("-inf")       # when the busy phase last changed kind
    mix_until: float = float("-inf")        # busy phases alternate fast: mix until then
    idle_since: float | None = None
    thermal: ThermalState = ThermalState()
    verdict: ThermalVerdict | None = None
    learned: Learned = Learned()            # residuals of the measured steps (power.policy.learn)
    # the last settled auto point per (phase kind, batch class): hysteresis
    chosen: Mapping[tuple[str, int], tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))
    decoding: bool = False                  # a decode step ran since the last idle: rows are mid-answer


# --- the cost model behind `auto` -----------------------------------------------------------------

def size_bucket(p: PhaseEvent) -> int:
    """Prefill: tokens to the next power of two (>= 16); decode: context to the next 256."""
    if p.kind == "prefill":
        return 1 << max(4, math.ceil(math.log2(max(1, p.n_tokens))))
    if p.kind == "decode":
        return 256 * max(1, math.ceil(p.context / 256))
    return 0


def served_size(p: PhaseEvent) -> int:
    """The size the planner predicts at: prefill tokens up to a multiple of 16, decode context up
    to a multiple of 32 (fine enough that the prediction is the served one, coarse enough to memoise)."""
    if p.kind == "prefill":
        return 16 * max(1, math.ceil(p.n_tokens / 16))
    return 32 * max(1, math.ceil(p.context / 32))


def prior_context(p: PhaseEvent, bucket: int = 1) -> int:
    """A prefill chunk's tokens already in the cache (the event's context is the positions in use after it;
    a later chunk of a long prompt attends to the earlier ones), rounded down to ``bucket``; 0 otherwise."""
    if p.kind != "prefill" or p.context <= 0:
        return 0
    before = max(0, p.context - p.n_tokens // max(1, p.batch))
    return before // bucket * bucket


PREFILL_CONTEXT_BUCKET = 256    # the planner's prefill context step (memoised grids)


@dataclass(frozen=True)
class Planner:
    """Predicted step time and energy per clock point, for one board, model shape and precision."""
    spec: BoardSpec
    shape: ModelShape
    precision: str
    tpcs: int
    params: CostParams = DEFAULT_PARAMS
    _memo: dict[tuple[object, ...], tuple[object, ...]] = field(default_factory=dict, compare=False,
                                                                 hash=False, repr=False)
    _grids: dict[tuple[object, ...], tuple[tuple[float, float, int, int], ...]] = field(
        default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def for_board(cls, spec: BoardSpec, shape: ModelShape, precision: str,
                  mode_id: int | None = None) -> "Planner":
        """The planner of ``shape`` (the served model's, or a preset's: power.runtime.shapes) on ``spec``
        in power mode ``mode_id`` (the board's default when None)."""
        m = spec.mode(spec.default_mode if mode_id is None else mode_id)
        return cls(spec, shape, precision, active_tpcs(spec, m.tpc_pg_mask))

    def candidates(self, kind: str, size: int, batch: int, gpus: tuple[int, ...],
                   emcs: tuple[int, ...], context: int = 0) -> tuple[tuple[float, float, int, int], ...]:
        """(seconds, joules per token, gpu, emc) for every point of the grid (memoised)."""
        key = ("grid", kind, size, batch, gpus, emcs, context)
        hit = self._grids.get(key)
        if hit is None:
            tokens = size if kind == "prefill" else batch
            hit = tuple((s, j / tokens, g, e) for g in gpus for e in emcs
                        for s, j in (self.predict(kind, size, batch, g, e, context),))
            self._grids[key] = hit
        return hit

    def predict(self, kind: str, size: int, batch: int, gpu_hz: int, emc_hz: int,
                context: int = 0) -> tuple[float, float]:
        """(seconds, joules) of one step of ``kind``: ``size`` = prefill tokens or decode context;
        ``context``: a prefill's tokens already cached."""
        return self._step(kind, size, batch, gpu_hz, emc_hz, context)[:2]  # type: ignore[return-value]

    def parts(self, kind: str, size: int, batch: int, gpu_hz: int, emc_hz: int,
              context: int = 0) -> tuple[float, float, float]:
        """The step's compute, memory and overhead times as fractions of its time (what the learned
        roofline multiplies, power.policy.learn)."""
        return self._step(kind, size, batch, gpu_hz, emc_hz, context)[2]  # type: ignore[return-value]

    def _step(self, kind: str, size: int, batch: int, gpu_hz: int, emc_hz: int, context: int) -> tuple[object, ...]:
        key = (kind, size, batch, gpu_hz, emc_hz, context)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        op = OperatingPoint(gpu_hz, emc_hz, self.tpcs)
        shape = self.shape
        if kind == "prefill":
            c = prefill_step(self.spec, shape, self.precision, op, size, context, self.params)
        else:
            c = decode_step(self.spec, shape, self.precision, op, max(1, size), batch, self.params)
        out = (c.seconds, c.energy_j, (c.compute_s / c.seconds, c.memory_s / c.seconds, c.overhead_s / c.seconds))
        self._memo[key] = out
        return out


# --- the controller -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Bounds:
    gpu_lo: int
    gpu_hi: int
    gpu_auto: bool
    emc: int | None             # None = auto
    cpu_max: int


class DvfsController:
    """Holds what never changes while serving (board tables, planner); ``decide`` is pure."""

    def __init__(self, tables: BoardTables, planner: Planner | None = None, explore: bool = True) -> None:
        self.tables = tables
        self.planner = planner
        # probe / explore / verify (power.policy.autopoint); off under a power budget, which decides which
        # points run (a probe of the top clocks would be capped away and never measured)
        self.explore = explore
        self._bounds: dict[tuple[int, str], _Bounds] = {}

    # -- profile -> bounds per phase
    def bounds(self, profile: Profile, phase: str) -> _Bounds:
        key = (hash(profile), phase)
        b = self._bounds.get(key)
        if b is None:
            t, pol = self.tables, profile.phase(phase)
            lo = resolve_clock(pol.gpu_min, t.gpu_hz, t.gpu_top, up=True)
            hi = resolve_clock(pol.gpu_max, t.gpu_hz, t.gpu_top, up=False)
            auto = lo is None or hi is None
            lo = t.gpu_hz[0] if lo is None else lo
            hi = t.gpu_top if hi is None else hi
            emc = resolve_clock(pol.emc, t.emc_hz, t.emc_top, up=True)
            cpu = resolve_clock(pol.cpu_max, t.cpu_khz, t.cpu_top, up=False, scale=1e-3)
            b = _Bounds(min(lo, hi), hi, auto, emc, t.cpu_top if cpu is None else cpu)
            self._bounds[key] = b
        return b

    def caps(self, profile: Profile) -> dict[str, tuple[int, int, int]]:
        """Per phase: the highest (GPU max, EMC, CPU max) the profile allows (property tests)."""
        out = {}
        for ph in ("prefill", "decode", "idle"):
            b = self.bounds(profile, ph)
            out[ph] = (b.gpu_hi, b.emc if b.emc is not None else self.tables.emc_top, b.cpu_max)
        return out

    def max_level(self) -> int:
        return len(self.tables.gpu_hz) + PREFILL_ONLY_LEVELS

    def floor(self) -> tuple[int, int, int, int]:
        t = self.tables
        return t.gpu_hz[0], t.gpu_hz[0], t.emc_hz[0], t.cpu_khz[0]

    # -- auto
    def _auto(self, p: PhaseEvent, b: _Bounds, gpu_cap: int, profile: Profile,
              state: DvfsState) -> tuple[int, int, float, str]:
        """(GPU Hz, EMC Hz, corrected predicted seconds, tag) of an auto phase."""
        assert self.planner is not None
        t = self.tables
        hi = min(b.gpu_hi, gpu_cap)
        gpus = [f for f in t.gpu_hz if b.gpu_lo <= f <= hi] or [min(b.gpu_lo, hi)]
        if not b.gpu_auto:
            gpus = [hi]
        emcs = [b.emc] if b.emc is not None else [f for f in t.emc_hz if f <= t.emc_top]
        size, batch, ctx = served_size(p), max(1, p.batch), prior_context(p, PREFILL_CONTEXT_BUCKET)
        base = self.planner.candidates(p.kind, size, batch, tuple(gpus), tuple(emcs), ctx)
        cands = corrected(base, state.learned.surface(p.kind, batch),
                          lambda g, e: self.planner.parts(p.kind, size, batch, g, e, ctx))
        lat = profile.latency
        slack, absolute = (lat.ttft_slack, lat.ttft_ms) if p.kind == "prefill" else (lat.tpot_slack, lat.tpot_ms)
        if p.kind == "prefill" and state.decoding:
            # rows are mid-answer (a decode step ran since the last idle): this prefill delays each of their
            # next tokens by its whole length, so it is held to the time-per-token slack too (a prefill
            # 10 % slower inside answers put p95 TPOT past +5 % on sampled boards, bench power --boards 16)
            slack = min(slack, lat.tpot_slack)
        running = (state.last.gpu_max_hz, state.last.emc_hz) if state.last is not None else None
        c = choose(cands, slack, absolute, state.chosen.get((p.kind, batch_class(p.kind, batch))), running)
        if c.learning and not self.explore:
            c = c.unless_learning()
        elif c.learning and (c.gpu_hz, c.emc_hz) != running and c.seconds < SWITCHED_MIN_S and \
                (state.last is None or state.last.phase != p.kind):
            # a short step after another phase's (a prefill between decode steps) starts with a switch and
            # measures nothing; the next step of a run of them would, so those learn
            c = c.unless_learning()
        return c.gpu_hz, c.emc_hz, c.seconds, c.tag

    def _busy_decision(self, p: PhaseEvent, profile: Profile, level: int, state: DvfsState) -> Decision:
        t = self.tables
        b = self.bounds(profile, p.kind)
        top_i = len(t.gpu_hz) - 1
        steps = level if p.kind == "prefill" else max(0, level - PREFILL_ONLY_LEVELS)
        gpu_cap = t.gpu_hz[max(0, top_i - steps)]
        predicted, tag = None, ""
        if b.gpu_auto or b.emc is None:
            if self.planner is not None:
                g, e, predicted, tag = self._auto(p, b, gpu_cap, profile, state)
                lo, hi = g, g
            else:   # no model to plan with: the textbook split (decode GPU-low/EMC-high, prefill GPU-high)
                frac = 1.0 if p.kind == "prefill" else 0.45
                g = min(snap(t.gpu_hz, frac * t.gpu_hz[-1], up=False), b.gpu_hi, gpu_cap)
                lo = hi = max(min(g, b.gpu_hi), min(b.gpu_lo, b.gpu_hi))
                e = b.emc if b.emc is not None else t.emc_top
            reason = "auto" + tag
        else:
            lo, hi, e = b.gpu_lo, b.gpu_hi, b.emc
            reason = "profile"
        hi = min(hi, gpu_cap)
        lo = min(lo, hi)
        if steps and gpu_cap < b.gpu_hi:
            reason += f", thermal level {level}"
        return Decision(p.kind, lo, hi, e, b.cpu_max, None, level, False, reason, predicted_s=predicted,
                        learning=bool(tag))

    def _learn(self, state: DvfsState, steps: tuple[StepSample, ...]) -> Learned:
        """Each measured busy step's time and power residuals against the model at the size it served."""
        learned = state.learned
        if not steps or self.planner is None:
            return learned
        if not learned.gpu_top:
            learned = Learned(learned.points, self.tables.gpu_hz[-1], self.tables.emc_hz[-1])
        for s in steps:
            if s.phase.kind not in ("prefill", "decode") or s.seconds <= 0:
                continue
            size = s.phase.n_tokens if s.phase.kind == "prefill" else s.phase.context
            batch, ctx = max(1, s.phase.batch), prior_context(s.phase)
            pred_s, pred_j = self.planner.predict(s.phase.kind, max(1, size), batch, s.gpu_hz, s.emc_hz, ctx)
            parts = self.planner.parts(s.phase.kind, max(1, size), batch, s.gpu_hz, s.emc_hz, ctx)
            watts = None if s.watts is None or s.watts <= 0 else math.log(s.watts * pred_s / pred_j)
            learned = learned.add(s.phase.kind, batch, s.gpu_hz, s.emc_hz, math.log(s.seconds / pred_s), watts, parts)
        return learned

    def decide(self, readings: Readings, phase: PhaseEvent, profile: Profile, state: DvfsState,
               now: float) -> tuple[Decision, DvfsState]:
        learned = self._learn(state, readings.steps)
        therm, verdict = state.thermal, state.verdict
        if readings.zones is not None:
            verdict, therm = thermal_step(readings.zones, profile.thermal, profile.fan, readings.fan_ours,
                                          state.thermal, now, self.max_level())
        level = therm.level
        critical = therm.critical
        key = (phase.kind, size_bucket(phase), phase.batch, level, critical, now < state.mix_until,
               hash(profile), phase.kind == "prefill" and state.decoding)
        busy_kind = phase.kind in ("prefill", "decode")
        # a probe or an exploration is decided anew once its step is measured
        fast = (state.last is not None and key == state.last_key and now - state.decided_s < RECHECK_S
                and readings.zones is None and not (state.last.learning and learned is not state.learned)
                and (busy_kind or state.idle_since is None or state.last.phase == "idle"))
        if fast:
            assert state.last is not None
            return state.last, replace(state, learned=learned)
        fan = verdict.fan_pwm if verdict is not None else None
        msg = verdict.message if verdict is not None else None
        new = replace(state, learned=learned, thermal=therm, verdict=verdict, last_key=key, decided_s=now)
        if critical:
            g0, g1, e, c = self.floor()
            where = (f"{verdict.hottest} at {verdict.hottest_c:.1f} °C" if verdict is not None
                     and verdict.hottest_c is not None else "last reading (zones now unreadable)")
            d = Decision("critical", g0, g1, e, c, fan, level, True, f"critical: {where}", message=msg)
            return d, replace(new, last=d, idle_since=None if busy_kind else state.idle_since)
        if busy_kind:
            plain = self._busy_decision(phase, profile, level, new)
            other, switched, mix_until = state.other, state.switched_s, state.mix_until
            if state.busy is not None and state.busy.phase != phase.kind:
                if now - state.switched_s < profile.timing.dwell_s:
                    mix_until = now + profile.timing.dwell_s
                other, switched = state.busy, now
            d = plain
            if other is not None and other.phase != phase.kind and now < mix_until:
                d = _elementwise_max(plain, other, f"{other.phase}/{phase.kind} alternating faster than "
                                                   f"dwell {profile.timing.dwell_s} s")
            d = replace(d, fan_pwm=fan, message=msg, wake_at=now + RECHECK_S)
            chosen = state.chosen
            if plain.reason.startswith("auto") and plain.predicted_s is not None and not plain.learning:
                cls = (phase.kind, batch_class(phase.kind, max(1, phase.batch)))
                chosen = MappingProxyType({**state.chosen, cls: (plain.gpu_max_hz, plain.emc_hz)})
            return d, replace(new, last=d, busy=plain, other=other, switched_s=switched, chosen=chosen,
                              mix_until=mix_until, idle_since=None, decoding=state.decoding or phase.kind == "decode")
        # idle: the engine has no rows
        new = replace(new, decoding=False)
        idle_since = state.idle_since if state.idle_since is not None else now
        hold = profile.timing.idle_hold_s
        if state.busy is not None and state.last is not None and state.last.phase != "idle" \
                and now - idle_since < hold:
            d = replace(state.busy, phase="idle-hold", reason=f"idle for < {hold} s: busy clocks held",
                        wake_at=idle_since + hold, fan_pwm=fan, message=msg, thermal_level=level)
            return d, replace(new, last=d, idle_since=idle_since)
        b = self.bounds(profile, "idle")
        top_i = len(self.tables.gpu_hz) - 1
        cap = self.tables.gpu_hz[max(0, top_i - level)]
        hi = min(b.gpu_hi, cap)
        d = Decision("idle", min(b.gpu_lo, hi), hi, b.emc if b.emc is not None else self.tables.emc_hz[0],
                     b.cpu_max, fan, level, False, "idle policy", wake_at=now + RECHECK_S, message=msg)
        return d, replace(new, last=d, idle_since=idle_since, busy=None, other=None)


def _elementwise_max(a: Decision, b: Decision, why: str) -> Decision:
    return replace(a, gpu_min_hz=max(a.gpu_min_hz, b.gpu_min_hz), gpu_max_hz=max(a.gpu_max_hz, b.gpu_max_hz),
                   emc_hz=max(a.emc_hz, b.emc_hz), cpu_max_khz=max(a.cpu_max_khz, b.cpu_max_khz),
                   reason=f"{a.reason}; {why}")


def tables_for(spec: BoardSpec, mode_id: int | None = None) -> BoardTables:
    """Board tables from a spec (the twin, the benchmark); on a board use :func:`tables_from_board`."""
    m = spec.mode(spec.default_mode if mode_id is None else mode_id)
    return BoardTables(spec.gpu_hz, spec.emc_hz, spec.cpu_khz, m.gpu_max_hz, m.emc_cap_hz, m.cpu_max_khz)
