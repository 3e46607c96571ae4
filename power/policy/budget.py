"""A power budget as a service-level objective: most tokens per second while the board's average power over
every sliding window of ``window_s`` stays at or below ``watts``.

Composes with the phase-aware DVFS controller (``power.policy.dvfs``): :class:`BudgetController` wraps a
:class:`DvfsController`, lets it decide (latency targets, thermal levels, critical floor, idle policy), then,
where the budget binds, replaces its busy clocks with the point the ceiling's price picks that keeps the
window average predicted within it. Pure like
``decide`` is: the board power measured by the rails comes in with the readings (``Readings.power_w``, the
power of the interval that just ended), ``now`` is passed in, no I/O.

- What is budgeted: module power (the rails' sum on AGX Orin, VDD_IN on Orin NX/Nano), or one named INA3221
  rail (``Budget.rail``: its reading comes in as ``power_w``, and every prediction is the cost model's power
  of that rail).
- Accounting (:func:`account`): each reading's power holds over the time since the previous one: one segment
  (t0, t1, W), merged with the last when its power is the same; segments older than a window are dropped. A
  window's joules are exact over those segments (:func:`window_energy`), and the guard checks every window
  ending within a window from now at each end where its energy can peak (:func:`window_pasts`: where a
  segment boundary slides out of it, the horizon, a window ahead). Slots of ``window_s / 40`` counted pro
  rata, as before, under-counted a window's oldest slot by up to 0.17 J and checked windows ending only every
  0.25 s: on Orin Nano at 5.4 W 10 s windows read up to 5.43 W (docs/BENCHMARKS.md, the power budget).
- Prediction: the cost model's board power at each (GPU, EMC) point for the phase at hand (the planner's
  step energy over its time, less the CPU floor of the cores the budget took offline), times a per-phase
  correction learned from the rails: an EWMA of log(measured / predicted) power of the intervals that ran a
  busy phase, per point that ran (:func:`correction`), the kind's over every point where a point has not run.
  One EWMA per kind missed a point-dependent error: on Orin Nano at 5.4 W it was learned on the low decode point,
  where it was exact, and put the high decode point 2.4-2.8 % under the rails in the last step of every 10 s
  window that went over (docs/BENCHMARKS.md, the power budget).
- The cap (:func:`allowed_power`): for every window that will end within one window from now, the energy
  already in it, plus the candidate's power over the decision's horizon, plus a *reserve* (what a large prefill
  chunk or a full decode batch draws at its least-power point) for the rest of that window, must stay
  <= ``watts x window_s``. The reserve keeps
  the plan feasible later: once admitted, a burst can always be followed by the floor. Energy that idle time
  left unused in the window is what prefill borrows: after an idle stretch the allowed power is high.
- The choice (power.policy.price): every point is priced at ``seconds x (1 + lam x (corrected W - budget))``,
  ``lam`` the price at which the equal-power ceiling's two hull ways around the budget tie
  (``power.policy.powerconfig``: the mode's grid, the cores the budget keeps online, the served mix), moved by
  the trailing window's headroom; the cheapest point that fits the window over its step and a recheck runs
  (the window only vetoes). So the points are the ceiling's own (prefill at a low GPU clock and the EMC floor,
  decode at the EMC top), not the fastest that fits. The DVFS decision's own point runs instead when it draws
  no more than the priced point and fits over its horizon (decode: a quarter window): the budget does not
  bind. Any EMC rate the power mode allows, the GPU at or below the thermal cap when a thermal level is in
  force, at or below ``peak_watts``. Thermal levels and the critical floor still override; idle passes
  through (a short idle-hold keeps the capped clocks).
- When even the least-power point does not fit, the floor is served and the verdict says the budget cannot
  be met (``unmet``; the decision carries a message for the log).
- Admission (:meth:`BudgetController.max_rows`): a last resort. While the last plan was unmet *and* the measured
  window average is over the budget (the floor is not holding it), the engine admits only as many decode rows
  as the least-power decode point can serve within the allowed power (at least one); rows already running
  finish. Not on "unmet" alone: at the floor a decode step's power hardly depends on its rows (it streams the
  weights either way), so fewer rows only cost tokens/s (measured: docs/BENCHMARKS.md, the power budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from power.physics.costmodel import OperatingPoint, decode_step, prefill_step
from power.policy.dvfs import Decision, DvfsController, DvfsState, Readings, served_size
from power.policy.phase import PhaseEvent
from power.policy.powerconfig import Mix, grid_points, ways_of
from power.policy.price import hull_price, pareto_front, price_at, price_cost
from power.policy.profiles import Budget, Profile
from power.policy.thermal import ThermalState, ThermalVerdict

__all__ = ["Budget", "BudgetController", "BudgetState", "BudgetStatus", "account", "allowed_power"]

RECHECK_S = 0.25            # re-plan the cap at least this often while a phase persists
POWER_ALPHA = 0.2           # EWMA weight of a new measured/predicted power ratio
BUSY = ("prefill", "decode")
DECODE_AHEAD = 0.25         # decode is planned over at least this fraction of the window
# the reserve is the least-power point of a large step of each kind (power at the floor grows with the work's
# intensity, so a big prefill chunk and a full decode batch bound what a phase draws at the floor)
RESERVE_PREFILL, RESERVE_CONTEXT, RESERVE_BATCH = 2048, 2048, 8
MIN_PRICE = 0.01            # x 1/W: the price where the budget does not bind (every point costs its time)
TIE = 1e-6                  # the price a hair above the hull's tie: of the two ways, the one within the budget


@dataclass(frozen=True)
class BudgetStatus:
    """What ``/metrics`` and ``power status`` show."""
    watts: float
    window_s: float
    window_avg_w: float         # measured average over the last window (the part seen so far)
    headroom_w: float           # watts - window average
    allowed_w: float            # the power the last plan allowed for its horizon
    unmet: bool                 # the last plan could not fit even the least-power point
    unmet_decisions: int
    capped_decisions: int
    max_rows: int | None = None     # the decode rows admission allows (None: no limit)


@dataclass(frozen=True)
class BudgetState:
    dvfs: DvfsState = DvfsState()
    segments: tuple[tuple[float, float, float], ...] = ()   # (t0, t1, W) measured, oldest first
    last_t: float | None = None
    running: tuple[str, float, int, int] | None = None   # (phase kind, predicted W, GPU Hz, EMC Hz) in force
    # log(measured / predicted) power, EWMA: per phase kind, and per (kind, GPU Hz, EMC Hz) that ran
    power_log: Mapping[str | tuple[str, int, int], float] = field(default_factory=lambda: MappingProxyType({}))
    planned_t: float = float("-inf")
    plain: Decision | None = None                    # the DVFS decision the last plan capped
    out: Decision | None = None                      # what the last plan returned
    status: BudgetStatus | None = None

    # what the loop and the service read from a DvfsState
    @property
    def thermal(self) -> ThermalState:
        return self.dvfs.thermal

    @property
    def verdict(self) -> ThermalVerdict | None:
        return self.dvfs.verdict


def account(budget: Budget, state: BudgetState, now: float, power_w: float | None) -> BudgetState:
    """Add the interval since the last reading at ``power_w`` as a segment; drop segments older than a window;
    learn the busy phase's power correction."""
    if power_w is None or not math.isfinite(power_w):
        return state if state.last_t is not None else replace(state, last_t=now)
    if state.last_t is None or now <= state.last_t:
        return replace(state, last_t=now if state.last_t is None else state.last_t)
    segs = list(state.segments)
    if segs and segs[-1][1] == state.last_t and segs[-1][2] == power_w:
        segs[-1] = (segs[-1][0], now, power_w)
    else:
        segs.append((state.last_t, now, power_w))
    first = next((k for k, sg in enumerate(segs) if sg[1] > now - budget.window_s), len(segs))
    log = state.power_log
    if state.running is not None and state.running[0] in BUSY and state.running[1] > 0 and power_w > 0:
        kind, pred, g, e = state.running
        x = math.log(power_w / pred)
        new = dict(log)
        for key in (kind, (kind, g, e)):
            old = log.get(key)
            new[key] = x if old is None else old + POWER_ALPHA * (x - old)
        log = MappingProxyType(new)
    kept = segs[first:]
    if kept and kept[0][0] < now - budget.window_s:        # the part older than a window is never read again
        kept[0] = (now - budget.window_s, *kept[0][1:])
    return replace(state, segments=tuple(kept), last_t=now, power_log=log)


def correction(state: BudgetState, kind: str, gpu_hz: int, emc_hz: int) -> float:
    """measured / predicted power at a point: its own EWMA where it ran, else the kind's (1 before any)."""
    log = state.power_log
    return math.exp(log.get((kind, gpu_hz, emc_hz), log.get(kind, 0.0)))


def window_energy(budget: Budget, state: BudgetState, start: float, end: float) -> float:
    """Joules measured in [start, end]: each segment's power over its part inside."""
    return sum(w * (min(t1, end) - max(t0, start)) for t0, t1, w in state.segments if min(t1, end) > max(t0, start))


def window_pasts(budget: Budget, state: BudgetState, now: float) -> tuple[tuple[float, float], ...]:
    """For the windows ending within a window from now: (seconds ahead, joules measured in it), at every end
    where a measured segment's boundary leaves the window, from the one ending now (0 ahead) to a window ahead
    (none measured), by rising ahead. Between two of these ends a window's measured joules fall linearly, so these and the horizon
    (:func:`allowed_power`) are where the guard's bound is tightest: every window is checked, none between
    grid points left out."""
    W = budget.window_s
    out, after = [(W, 0.0)], 0.0            # after: joules measured from the boundary at hand to now
    for t0, t1, w in reversed(state.segments):
        if now - W < t1 < now and out[-1][0] > t1 + W - now:
            out.append((t1 + W - now, after))
        after += w * max(0.0, t1 - max(t0, now - W))
        if now - W < t0 < now:
            out.append((t0 + W - now, after))
    out.append((0.0, after))                # the window ending now: what the ends ahead interpolate from
    return tuple(out[::-1])


def allowed_power(budget: Budget, pasts: tuple[tuple[float, float], ...], horizon_s: float, reserve_w: float) -> float:
    """The most power a point may draw for ``horizon_s`` from now so that every window ending within a
    window from now stays within the budget, the rest of each window served at ``reserve_w``. ``pasts``:
    (seconds ahead, joules measured) by rising ahead, the measured joules linear between them
    (:func:`window_pasts`); the window ending at the horizon is interpolated between its neighbours. The window
    ending now is past changing (0 ahead: not a bound)."""
    cap = budget.watts * budget.window_s
    ends = list(pasts)
    for (a0, e0), (a1, e1) in zip(pasts, pasts[1:]):
        if a0 < horizon_s < a1:
            ends.append((horizon_s, e0 + (e1 - e0) * (horizon_s - a0) / (a1 - a0)))
    return min((cap - past - max(0.0, ahead - horizon_s) * reserve_w) / min(horizon_s, ahead)
               for ahead, past in ends if ahead > 0)


def window_average(budget: Budget, state: BudgetState, now: float) -> float:
    """Measured average over the window ending now (over the part seen, before a full window has passed)."""
    if state.last_t is None or not state.segments:
        return 0.0
    span = min(budget.window_s, now - state.segments[0][0])
    return window_energy(budget, state, now - budget.window_s, now) / max(span, 1e-9)


def pareto(points: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The (seconds, watts, GPU Hz, EMC Hz) points no other point beats on both time and power, fastest first."""
    return pareto_front(points, power=lambda c: c[1], speed=lambda c: -c[0])[::-1]


class BudgetController:
    """A :class:`DvfsController` whose busy clocks are capped to a power budget. ``decide`` is pure; the
    state is a :class:`BudgetState` (it carries the DVFS state)."""

    def __init__(self, dvfs: DvfsController, budget: Budget, mix: Mix | None = None,
                 cores_online: int | None = None) -> None:
        if dvfs.planner is None:
            raise ValueError("a power budget needs the cost model (a model shape) to predict power per clock point")
        self.dvfs, self.budget = dvfs, budget
        dvfs.explore = False        # the budget picks the points that run: the DVFS controller learns from them only
        self.tables, self.planner = dvfs.tables, dvfs.planner
        labels = [r.label for r in dvfs.planner.spec.rails if r.label != "NC"]
        if budget.rail is not None and budget.rail not in labels:
            raise ValueError(f"budget rail {budget.rail!r}: {dvfs.planner.spec.name} has {', '.join(labels)} "
                             f"(leave rail out to budget module power)")
        self._rail_memo: dict[tuple[object, ...], float] = {}
        self.mix, self.cores_online = mix or Mix(), cores_online
        spec = dvfs.planner.spec
        # the planner models every core online; the cores the budget took offline draw none of the CPU floor
        # (power.physics.equations.power: cpu_floor_w x online / cpu_count, its only term in the online count)
        self._cores_off_w = (0.0 if cores_online is None else
                             spec.power.cpu_floor_w * (spec.cpu_count - min(spec.cpu_count, cores_online)) / spec.cpu_count)
        self.hull_price = self._hull_price()

    def _hull_price(self) -> float:
        """The price at which the equal-power ceiling's two hull ways around the budget tie
        (power.policy.price.hull_price) on this controller's own grid (the mode's caps, the planner's model),
        for ``self.mix`` and the CPU cores the budget keeps online; a small positive price where the fastest way fits (the budget does not bind)."""
        assert self.planner is not None
        pl, t = self.planner, self.tables
        gpus = [f for f in t.gpu_hz if f <= t.gpu_top]
        emcs = [f for f in t.emc_hz if f <= t.emc_top]
        pre, dec = grid_points(pl.spec, pl.shape, pl.precision, pl.tpcs, gpus, emcs, self.cores_online, self.mix, 1.0,
                               self.budget.rail)
        lam = hull_price(ways_of(pre, dec, self.mix), self.budget.watts) * (1.0 + TIE)
        return max(lam, MIN_PRICE / self.budget.watts)

    def power_of(self, kind: str, size: int, batch: int, gpu_hz: int, emc_hz: int) -> float:
        """The cost model's power of one step at a point: board power, or the budget's rail's."""
        assert self.planner is not None
        pl = self.planner
        if self.budget.rail is None:
            sec, j = pl.predict(kind, size, batch, gpu_hz, emc_hz)
            return j / sec - self._cores_off_w
        key = (kind, size, batch, gpu_hz, emc_hz)
        w = self._rail_memo.get(key)
        if w is None:
            op = OperatingPoint(gpu_hz, emc_hz, pl.tpcs, cores_online=self.cores_online)
            c = (prefill_step(pl.spec, pl.shape, pl.precision, op, size, 0, pl.params) if kind == "prefill"
                 else decode_step(pl.spec, pl.shape, pl.precision, op, max(1, size), batch, pl.params))
            w = self._rail_memo[key] = dict(c.rails_w)[self.budget.rail]
        return w

    def initial_state(self) -> BudgetState:
        return BudgetState()

    def max_level(self) -> int:
        return self.dvfs.max_level()

    def floor(self) -> tuple[int, int, int, int]:
        return self.dvfs.floor()

    def points(self, p: PhaseEvent, dstate: DvfsState) -> list[tuple[float, float, int, int]]:
        """(corrected seconds, predicted board W, gpu, emc) for every point the board's mode allows."""
        assert self.planner is not None
        t = self.tables
        gpus = tuple(f for f in t.gpu_hz if f <= t.gpu_top)
        emcs = tuple(f for f in t.emc_hz if f <= t.emc_top)
        size, batch = served_size(p), max(1, p.batch)
        tokens = size if p.kind == "prefill" else batch
        pl = self.planner
        surf = dstate.learned.surface(p.kind, batch)

        def ratio(g: int, e: int) -> float:     # measured / model step time (power.policy.learn)
            return math.exp(surf.at(g, e, pl.parts(p.kind, size, batch, g, e)).log_time)
        if self.budget.rail is None:
            return [(s * ratio(g, e), jt * tokens / s - self._cores_off_w, g, e)
                    for s, jt, g, e in pl.candidates(p.kind, size, batch, gpus, emcs)]
        return [(s * ratio(g, e), self.power_of(p.kind, size, batch, g, e), g, e)
                for s, _, g, e in pl.candidates(p.kind, size, batch, gpus, emcs)]

    def horizon(self, p: PhaseEvent, step_s: float) -> float:
        """How long a point is planned to run: its step and a recheck; decode at least a quarter window (a
        decode stretch lasts seconds: planning it whole keeps its speed even instead of fast-then-floor)."""
        h = RECHECK_S + step_s
        return max(h, self.budget.window_s * DECODE_AHEAD) if p.kind == "decode" else h

    def step_power(self, p: PhaseEvent, d: Decision) -> float:
        """The cost model's power (board, or the budget's rail) of the step ``p`` at the decision's clocks (what
        the rails are compared with)."""
        return self.power_of(p.kind, served_size(p), max(1, p.batch), d.gpu_max_hz, d.emc_hz)

    def reserve(self, st: BudgetState) -> float:
        """The power any busy phase draws at its least-power point (corrected): what the rest of a window is
        planned at, so that after any admitted point the floor still fits."""
        out = 0.0
        for p in (PhaseEvent("prefill", n_tokens=RESERVE_PREFILL), PhaseEvent("decode", context=RESERVE_CONTEXT,
                                                                          batch=RESERVE_BATCH)):
            floor = min(w * max(1.0, correction(st, p.kind, g, e)) for _, w, g, e in self.points(p, st.dvfs))
            out = max(out, floor)
        return out

    def decide(self, readings: Readings, phase: PhaseEvent, profile: Profile, state: BudgetState,
               now: float) -> tuple[Decision, BudgetState]:
        b = self.budget
        st = account(b, state, now, readings.power_w)
        d, dstate = self.dvfs.decide(readings, phase, profile, st.dvfs, now)
        st = replace(st, dvfs=dstate)
        if d.critical or d.phase not in (*BUSY, "idle-hold"):
            status = self._status(st, now, st.status.allowed_w if st.status else b.watts, False, 0)
            return d, replace(st, running=(d.phase, 0.0, 0, 0), plain=None, out=d, status=status)
        if d.phase == "idle-hold":          # busy clocks held through a short gap: the capped ones
            out = st.out if st.out is not None and st.out.phase in BUSY else d
            held = replace(d, gpu_min_hz=min(d.gpu_min_hz, out.gpu_max_hz), gpu_max_hz=min(d.gpu_max_hz, out.gpu_max_hz),
                           emc_hz=min(d.emc_hz, out.emc_hz))
            return held, replace(st, running=("idle", 0.0, 0, 0))
        if st.plain == d and st.out is not None and now - st.planned_t < RECHECK_S:
            # the plan holds; what the rails will be compared with is this step's power at those clocks
            return st.out, replace(st, running=self._running(phase, st.out))
        return self._plan(d, phase, st, now)

    def _running(self, p: PhaseEvent, d: Decision) -> tuple[str, float, int, int]:
        """What the next reading's interval ran: the step's kind, its model power at the clocks, the clocks."""
        return (p.kind, self.step_power(p, d), d.gpu_max_hz, d.emc_hz)

    def ranked(self, pts: list[tuple[float, float, int, int]], corr: float,
               lam: float) -> list[tuple[float, float, int, int]]:
        """``pts`` cheapest first at price ``lam`` (corrected power; ties: the faster)."""
        w = self.budget.watts
        return sorted(pts, key=lambda c: (price_cost(c[0], c[1] * corr, w, lam), c[0]))

    def headroom(self, st: BudgetState, now: float) -> float:
        """Joules the trailing window has left under the budget (its average over the part seen so far)."""
        b = self.budget
        return (b.watts - window_average(b, st, now)) * b.window_s if st.segments else 0.0

    def price(self, st: BudgetState, now: float) -> float:
        """The price of power now (1/W): the hull's, moved by the window's headroom (power.policy.price)."""
        return price_at(self.hull_price, self.headroom(st, now), self.budget.watts, self.budget.window_s)

    def _plan(self, d: Decision, phase: PhaseEvent, st: BudgetState, now: float) -> tuple[Decision, BudgetState]:
        b = self.budget
        # every point at its corrected power (measured / predicted: the point's own where it ran)
        pts = [(s, w * correction(st, phase.kind, g, e), g, e) for s, w, g, e in self.points(phase, st.dvfs)]
        reserve = self.reserve(st)
        # any EMC rate the mode allows; the GPU under the thermal cap when one is in force (thermal overrides)
        gpu_cap = d.gpu_max_hz if d.thermal_level > 0 else self.tables.gpu_top
        mine = [c for c in pts if c[2] <= gpu_cap] or [min(pts, key=lambda c: c[1])]
        pasts = window_pasts(b, st, now)
        lam = self.price(st, now)

        def room(c: tuple[float, float, int, int], horizon: float) -> float:
            a = allowed_power(b, pasts, horizon, reserve)
            return a if b.peak_watts is None else min(a, b.peak_watts)
        # every point that fits the window over its step and a recheck, cheapest at the price first: the price
        # picks the ceiling's point (power.policy.price); the window only vetoes
        allowed, fits = b.watts, []
        for c in self.ranked(mine, 1.0, lam):
            allowed = room(c, RECHECK_S + c[0])
            if c[1] <= allowed:
                fits = [c]
                break
        unmet = not fits
        cur = next((c for c in mine if (c[2], c[3]) == (d.gpu_max_hz, d.emc_hz)), None)
        if unmet:
            best = min(pts, key=lambda c: (c[1], c[0]))          # the least-power point of the whole board
        elif cur is not None and cur[1] <= fits[0][1] and cur[1] <= room(cur, self.horizon(phase, cur[0])):
            best = cur          # the profile's own point draws no more than the price allows: the budget does not bind
        else:
            best = fits[0]
        capped = cur is None or best != cur
        out = d
        if capped:
            g, e = best[2], best[3]
            out = replace(d, gpu_min_hz=min(d.gpu_min_hz, g), gpu_max_hz=g, emc_hz=e, predicted_s=best[0],
                          reason=f"{d.reason}; budget {b.watts:g} W: {allowed:.1f} W allowed")
        if unmet:
            out = replace(out, message=f"power budget {b.watts:g} W over {b.window_s:g} s cannot be met even at "
                          f"the floor ({best[1]:.1f} W predicted, {allowed:.1f} W allowed): serving at the floor")
        over = unmet and window_average(b, st, now) > b.watts      # the floor is not holding the window
        status = replace(self._status(st, now, allowed, unmet, int(capped)),
                         max_rows=self._rows(st, allowed) if over else None)
        return out, replace(st, running=self._running(phase, out), plain=d, out=out, planned_t=now,
                            status=status)

    def _rows(self, st: BudgetState, allowed: float) -> int:
        """The most decode rows whose least-power step fits ``allowed`` (corrected), at least one."""
        for rows in range(RESERVE_BATCH, 0, -1):
            p = PhaseEvent("decode", context=RESERVE_CONTEXT, batch=rows)
            if min(w * correction(st, "decode", g, e) for _, w, g, e in self.points(p, st.dvfs)) <= allowed:
                return rows
        return 1

    def max_rows(self, state: BudgetState, engine_max: int) -> int:
        """How many decode rows the engine may admit now: ``engine_max`` unless the floor is not holding the window."""
        st = state.status
        return engine_max if st is None or st.max_rows is None else max(1, min(engine_max, st.max_rows))

    def _status(self, st: BudgetState, now: float, allowed: float, unmet: bool, capped: int) -> BudgetStatus:
        b = self.budget
        avg = window_average(b, st, now)
        prev = st.status
        return BudgetStatus(b.watts, b.window_s, avg, b.watts - avg, allowed, unmet,
                            (prev.unmet_decisions if prev else 0) + int(unmet),
                            (prev.capped_decisions if prev else 0) + capped)
