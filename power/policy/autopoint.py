"""The ``auto`` clock point: least corrected joules per token within the latency limit, and what to measure
next while the corrections are still unknown (a probe of the top clocks, explorations, verifications).

Used by :class:`power.policy.dvfs.DvfsController` for every auto phase. Pure: the planner's predictions and
what was learned (:mod:`power.policy.learn`) come in, a point and why go out.

A candidate's time is the model's times exp(time correction), its energy per token the model's times
exp(time correction + power correction) (the rails burn for as long as the step runs, at the power they
read). The limit is the anchor's time x (1 + slack), or an absolute target; the anchor is the fastest of
the measured points and the top clocks (on a board a higher clock never makes a step slower, so the top
is where the fastest is; a point only the fit calls faster is no anchor). The rules, in order:

1. Nothing measured in this phase and batch class: the model's choice.
2. The top clocks not measured: probe them (the limit hangs on them).
3. The corrected optimum not measured: go there (explore).
4. A point not measured that could beat the choice were each roofline multiplier no measurement has pinned
   down ``learn.OPTIMISM`` prior deviations faster (a compute rate never measured, say): explore it.
5. A point on one axis between the choice and a measured point below it found too slow: the middle one
   (bisection) of those that could still fit and beat the choice by more than the hysteresis, bounded by the
   board's monotonicity (no faster than the slowest measured point at clocks no lower on either axis), not by
   the fit, which can call them all too slow across a roofline's knee.
6. A neighbour of the choice along either axis predicted within ``LOCAL_LOG`` of its J/token and
   ``LOCAL_LIMIT_LOG`` of the limit: explore it (a roofline and a plane only follow a curved error so
   far, and a choice next to the limit is where a few % of error moves the optimum).
   Rules 3-6 stop at ``MAX_POINTS`` measured points per phase and batch class; then only measured points
   are chosen.
7. The choice could be wrong within the noise on the means (it may be past the limit, or a cheaper measured
   point may fit after all): the noisiest of the points that decide it is measured again (verify), up to
   ``VERIFY_SAMPLES`` each; differences under ``RESOLVED_LOG`` are not chased.
8. Hysteresis: the last settled point stays while it is within ``HYSTERESIS_LOG`` of the cheapest and
   ``KEEP_SIGMAS`` standard deviations of the limit. Within the noise of the two means a point counts as
   fitting the limit (rule 7 takes the steps that tell).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from power.policy.learn import Parts, Surface

HYSTERESIS_LOG = 0.02       # keep the last point unless another is > 2 % cheaper (smoothed noise)
KEEP_SIGMAS = 3.0           # ... and while within three standard deviations of the limit (a mean wandering)
LOCAL_LOG = 0.03            # a neighbour predicted within 3 % of the choice's J/token ...
LOCAL_LIMIT_LOG = 0.10      # ... and 10 % of the limit may be the better point (a curved error)
TIE = 1e-3                  # step times this close are one time (the anchor: the higher clocks)
VERIFY_SIGMAS = 2.0         # a choice within two standard deviations of being wrong is measured again
RESOLVED_LOG = 0.002        # ... unless that band is under 0.2 %: finer than any latency target means
VERIFY_SAMPLES = 100        # ... until each point it hangs on has this many samples
MAX_POINTS = 10             # measured points per phase and batch class: the first, the probe, eight more


@dataclass(frozen=True)
class Candidate:
    seconds: float              # corrected step time
    joules_per_token: float     # corrected
    gpu_hz: int
    emc_hz: int
    measured: bool
    log_time: float = 0.0       # the corrections applied (log measured / model)
    log_power: float = 0.0
    sd: float = 0.0             # uncertainty of the measured time residual
    sd_j: float = 0.0           # and of the energy's (time and power)
    samples: int = 0
    optimistic_s: float = 0.0   # the time were the multipliers not pinned down faster (learn.OPTIMISM)


@dataclass(frozen=True)
class Choice:
    gpu_hz: int
    emc_hz: int
    seconds: float              # corrected predicted step time there
    tag: str                    # "", " (probe)", " (explore)", " (verify)"
    settled: "Choice | None" = None     # a probe's, exploration's or verification's best point meanwhile

    @property
    def learning(self) -> bool:
        return bool(self.tag)

    def unless_learning(self) -> "Choice":
        """The best point for now when this step cannot measure anything (it is too short to count)."""
        return self.settled if self.settled is not None else self


def corrected(base: tuple[tuple[float, float, int, int], ...], surf: Surface,
              parts: Callable[[int, int], Parts]) -> list[Candidate]:
    """The planner's (seconds, J/token, gpu, emc) grid with the learned corrections applied; ``parts``
    gives the model's compute, memory and overhead shares of the step at a point."""
    out = []
    for s, jt, g, e in base:
        c = surf.at(g, e, parts(g, e))
        out.append(Candidate(s * math.exp(c.log_time), jt * math.exp(c.log_time + c.log_power), g, e,
                             c.samples > 0, c.log_time, c.log_power, c.sd_time, math.hypot(c.sd_time, c.sd_power),
                             c.samples, s * math.exp(c.log_time_optimistic)))
    return out


def limit_of(fastest_s: float, slack: float, absolute_ms: float) -> float:
    """The step time a point may take: ``slack`` over the fastest, or an absolute target (never below the
    fastest: a target the board cannot meet is served at full speed)."""
    limit = fastest_s * (1 + slack)
    if absolute_ms > 0:
        limit = max(fastest_s, min(limit, absolute_ms / 1000.0))
    return limit


def choose(cands: list[Candidate], slack: float, absolute_ms: float, last: tuple[int, int] | None,
           running: tuple[int, int] | None = None) -> Choice:
    """The point to run next (rules in the module docstring); ``last``: the last settled point, ``running``:
    the point in force now."""
    pick, learn = _choose(cands, slack, absolute_ms, last, running)
    return pick if learn is None else replace(learn, settled=pick)


def _choose(cands: list[Candidate], slack: float, absolute_ms: float, last: tuple[int, int] | None,
            running: tuple[int, int] | None) -> tuple[Choice, Choice | None]:
    """(the best point, the point to learn at instead or None)."""
    top = max(cands, key=lambda c: (c.gpu_hz, c.emc_hz))
    anchors = [c for c in cands if c.measured or c is top]
    quickest = min(c.seconds for c in anchors)
    fastest = max((c for c in anchors if c.seconds <= quickest * (1 + TIE)), key=lambda c: (c.gpu_hz, c.emc_hz))
    limit = limit_of(fastest.seconds, slack, absolute_ms)

    def noise(c: Candidate) -> float:
        return math.hypot(c.sd, fastest.sd) if c is not fastest else 0.0

    def fits(c: Candidate) -> bool:
        return c.seconds <= limit * math.exp(noise(c)) * (1 + 1e-9)

    keep = next((c for c in cands if (c.gpu_hz, c.emc_hz) == last
                 and c.seconds <= limit * math.exp(KEEP_SIGMAS * noise(c)) * (1 + 1e-9)), None)

    def settle(pool: list[Candidate]) -> Candidate:
        best = min(pool, key=lambda c: (c.joules_per_token, c.seconds))
        if keep is not None and (keep.measured or not best.measured) \
                and keep.joules_per_token <= best.joules_per_token * math.exp(HYSTERESIS_LOG):
            return keep
        return best

    best = settle([c for c in cands if fits(c)])
    measured = [c for c in cands if c.measured]

    def at(c: Candidate, tag: str = "") -> Choice:
        return Choice(c.gpu_hz, c.emc_hz, c.seconds, tag)

    if not measured:
        return at(best), None
    room = len(measured) < MAX_POINTS
    # the point to run when a step cannot learn (power.policy.dvfs: under a budget, a short step after a
    # switch) is the corrected optimum, measured or not
    if room and not top.measured:
        return at(best), at(top, " (probe)")
    if not best.measured:
        if room:
            return at(best), at(best, " (explore)")
        known = [c for c in measured if fits(c)]
        best = settle(known) if known else min(measured, key=lambda c: c.seconds)
    elif room and (hope := _hopeful(cands, best, limit)) is not None:
        return at(best), at(hope, " (explore)")
    elif room and (mid := _bracketed(cands, best, limit, fits)) is not None:
        return at(best), at(mid, " (explore)")
    elif room:
        near = [c for c in _neighbours(cands, best) if not c.measured and c.seconds <= limit * math.exp(LOCAL_LIMIT_LOG)
                and c.joules_per_token <= best.joules_per_token * math.exp(LOCAL_LOG)]
        if near:
            return at(best), at(min(near, key=lambda c: c.joules_per_token), " (explore)")
    again = _verify(measured, best, fastest, limit, running)
    return at(best), (at(again, " (verify)") if again is not None else None)


def _hopeful(cands: list[Candidate], best: Candidate, limit: float) -> Candidate | None:
    """The unmeasured point of least optimistic J/token that would fit the limit and beat ``best`` by more
    than the hysteresis at its optimistic time (the power at a point does not follow the time)."""
    hope = [c for c in cands if not c.measured and c.optimistic_s <= limit
            and c.joules_per_token * c.optimistic_s / c.seconds < best.joules_per_token * math.exp(-HYSTERESIS_LOG)]
    return min(hope, key=lambda c: c.joules_per_token * c.optimistic_s / c.seconds) if hope else None


def _bracketed(cands: list[Candidate], best: Candidate, limit: float,
               fits: Callable[[Candidate], bool]) -> Candidate | None:
    """Rule 5: between the choice and a measured point below it on one axis found too slow, the middle one of
    the unmeasured points that could still beat the choice (bisection). What bounds them is the board, not the
    fit: a lower clock never makes a step faster, so an unmeasured point takes at least as long as the slowest
    measured point at clocks no lower on either axis, and its J/token is at least its corrected power times
    that. A fit through two measured points either side of a roofline's knee (memory-bound at one, compute-
    bound at the other) can call every point between them too slow when they fit."""
    measured = [c for c in cands if c.measured]
    pick = []
    for axis in (0, 1):
        line = sorted((c for c in cands if (c.gpu_hz, c.emc_hz)[1 - axis] == (best.gpu_hz, best.emc_hz)[1 - axis]),
                      key=lambda c: (c.gpu_hz, c.emc_hz)[axis])
        i = line.index(best)
        slow = [j for j in range(i) if line[j].measured and not fits(line[j])]
        if not slow:
            continue
        hope = []
        for x in line[max(slow) + 1:i]:
            if x.measured:
                continue
            least = max(c.seconds for c in measured if c.gpu_hz >= x.gpu_hz and c.emc_hz >= x.emc_hz)
            if least <= limit * (1 + 1e-9) and \
                    x.joules_per_token / x.seconds * least < best.joules_per_token * math.exp(-HYSTERESIS_LOG):
                hope.append(x)
        if hope:
            pick.append(hope[len(hope) // 2])
    return min(pick, key=lambda c: c.joules_per_token) if pick else None


def _neighbours(cands: list[Candidate], c: Candidate) -> list[Candidate]:
    """The points one table step from ``c`` along the GPU clock or the EMC rate."""
    gpus = sorted({x.gpu_hz for x in cands})
    emcs = sorted({x.emc_hz for x in cands})
    gi, ei = gpus.index(c.gpu_hz), emcs.index(c.emc_hz)
    want = {(gpus[i], c.emc_hz) for i in (gi - 1, gi + 1) if 0 <= i < len(gpus)}
    want |= {(c.gpu_hz, emcs[i]) for i in (ei - 1, ei + 1) if 0 <= i < len(emcs)}
    return [x for x in cands if (x.gpu_hz, x.emc_hz) in want]


def _verify(measured: list[Candidate], best: Candidate, fastest: Candidate, limit: float,
           running: tuple[int, int] | None) -> Candidate | None:
    """Rule 7: the point to measure again while the choice could be wrong within the noise of the means
    (``best`` may be past the limit, or a cheaper measured point, the rival, may fit after all): the
    noisiest of ``best``, the rival and the anchor, each until it has ``VERIFY_SAMPLES``; the point running
    now while it is one of them (each switch costs a step that measures nothing)."""
    k = VERIFY_SIGMAS
    hang = []
    band = k * math.hypot(best.sd, fastest.sd)
    if best is not fastest and RESOLVED_LOG < band and abs(math.log(best.seconds / limit)) < band:
        hang += [best, fastest]

    def could_fit(c: Candidate) -> bool:
        band = k * math.hypot(c.sd, fastest.sd)
        return c.seconds <= limit or (band > RESOLVED_LOG and c.seconds * math.exp(-band) <= limit)

    rivals = [c for c in measured if c is not best and could_fit(c)
              and c.joules_per_token < best.joules_per_token * math.exp(-HYSTERESIS_LOG)]
    if rivals:
        hang += [min(rivals, key=lambda c: c.joules_per_token), best, fastest]
    pool = [c for c in hang if c.measured and c.samples < VERIFY_SAMPLES]
    if not pool:
        return None
    now = next((c for c in pool if (c.gpu_hz, c.emc_hz) == running), None)
    return now if now is not None else max(pool, key=lambda c: max(c.sd, c.sd_j))
