"""The power loop: sensors -> the pure controller (``power.policy.dvfs.decide``, or the budget's) -> the
applier, driven by phase events and timer ticks with the time passed in.

The synchronous core of the service's :class:`power.runtime.controller.PowerController` thread and of the
energy benchmark in virtual time: on a phase event it turns the time since the previous event into a
measured step sample (with the board power the rails read as it ends, where a reader is given), samples the thermal zones at most once per ``sensor_period_s``, calls ``decide``
and applies the decision through :class:`power.runtime.applier.ClockApplier`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from power.policy.budget import BudgetController
from power.policy.dvfs import SWITCHED_MIN_S, Decision, DvfsController, DvfsState, Readings, StepSample
from power.policy.phase import PhaseEvent
from power.policy.profiles import Profile
from power.policy.thermal import ZoneSample
from power.runtime.applier import ClockApplier

log = logging.getLogger("orin_agent.power")


@dataclass
class LoopStats:
    events: int = 0
    decisions: int = 0
    switches: int = 0
    writes: int = 0
    critical_entries: int = 0
    messages: list[str] = field(default_factory=list)


class PowerLoop:
    """Sensors -> ``decide`` -> applier, driven by phase events and timer ticks (time passed in)."""

    def __init__(self, controller: DvfsController, profile: Profile, applier: ClockApplier | None,
                 zones: Callable[[], tuple[ZoneSample, ...]] | None, *, fan_ours: bool = False,
                 sensor_period_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 power: Callable[[], float | None] | None = None,
                 step_power: Callable[[], float | None] | None = None) -> None:
        self.controller, self.profile, self.applier = controller, profile, applier
        self.zones, self.fan_ours, self.sensor_period_s = zones, fan_ours, sensor_period_s
        self.power = power          # board power now (W), read at every decision when set (a budget's input)
        self.step_power = step_power    # board power now (W), stamped on each measured step (auto learns it)
        self.state = DvfsState()
        self.decision: Decision | None = None
        self.stats = LoopStats()
        self._clock = clock
        self._phase = PhaseEvent("idle")
        self._phase_t: float | None = None
        self._sensed_t = float("-inf")
        self._switched = False
        self.applied: dict[str, Decision] = {}      # the last clocks decided per busy phase

    @property
    def sensed_at(self) -> float:
        """When the zones were last read."""
        return self._sensed_t

    @property
    def phase(self) -> PhaseEvent:
        return self._phase

    def set_profile(self, profile: Profile) -> None:
        self.profile = profile

    def on_event(self, p: PhaseEvent, now: float) -> Decision:
        steps: tuple[StepSample, ...] = ()
        d = self.decision
        # a step measures its clock point when the clocks were pinned and did not move at its start; a step
        # that began with a switch includes the 5-8 ms the new clocks take to settle, so it counts only when
        # it is long enough for that to be a few % of it (a prefill chunk after decode steps: almost every
        # prefill starts with a switch, and would otherwise never be measured)
        if self._phase.kind != "idle" and self._phase_t is not None and d is not None and \
                d.gpu_min_hz == d.gpu_max_hz and (not self._switched or now - self._phase_t >= SWITCHED_MIN_S):
            # the rails read now, as the step ends: the step's power (INA3221 averages over ~ms)
            watts = self.step_power() if self.step_power is not None else None
            steps = (StepSample(self._phase, d.gpu_max_hz, d.emc_hz, now - self._phase_t, watts),)
        self._phase, self._phase_t = p, now
        self.stats.events += 1
        before = self.stats.switches
        out = self._decide(now, steps)
        self._switched = self.stats.switches != before
        return out

    def tick(self, now: float) -> Decision:
        return self._decide(now, ())

    def max_rows(self, engine_max: int) -> int | None:
        """The decode rows the budget lets the engine admit now (None: no budget on this loop)."""
        ctl = self.controller
        return ctl.max_rows(self.state, engine_max) if isinstance(ctl, BudgetController) else None  # type: ignore[arg-type]

    def next_wake(self) -> float | None:
        w = self.decision.wake_at if self.decision is not None else None
        if self.zones is not None:
            nxt = self._sensed_t + self.sensor_period_s
            w = nxt if w is None else min(w, nxt)
        return w

    def _decide(self, now: float, steps: tuple[StepSample, ...]) -> Decision:
        zones = None
        if self.zones is not None and now - self._sensed_t >= self.sensor_period_s:
            zones, self._sensed_t = self.zones(), now
        readings = Readings(zones, self.fan_ours, steps, self.power() if self.power is not None else None)
        was_critical = self.state.thermal.critical
        d, self.state = self.controller.decide(readings, self._phase, self.profile, self.state, now)
        self.stats.decisions += 1
        if d.message and (d.critical or d.message != (self.decision.message if self.decision else None)):
            (log.error if d.critical else log.warning)("%s", d.message)
            if len(self.stats.messages) < 100:
                self.stats.messages.append(f"t={now:.1f}s {d.message}")
        if d.critical and not was_critical:
            self.stats.critical_entries += 1
        if self.decision is None or d.clocks() != self.decision.clocks() or d.fan_pwm != self.decision.fan_pwm:
            self.stats.switches += 1
            if self.applier is not None:
                self.stats.writes += self.applier.apply(d, self.fan_ours)
        self.decision = d
        if d.phase in ("prefill", "decode"):
            self.applied[d.phase] = d
        return d
