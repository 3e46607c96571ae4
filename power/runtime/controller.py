"""The service's power controller: a :class:`agent.phases.PhaseListener` that runs the pure DVFS and
thermal controllers on its own thread and applies their decisions through the journaled board layer.

``on_phase`` only queues the event (the engine thread must not wait on sysfs); the thread wakes on
events, on the controller's timers (idle hold, 1 s re-checks) and on the sensor period, and writes a
small state file (``<run_dir>/power-state.json``) that ``orin-agent power status`` shows. ``stop()``
puts every changed file back (journal restore). Any write error restores the journal, logs it and
disables the controller: the service keeps serving at the board's own clocks.

Wiring (agent/service.py): ``PowerController.open(root, run_dir, profile)`` (one board session) and pass it as the
service's ``listener`` (or inside ``FanOut``); call ``start()`` after the engine starts and
``stop()`` before the board is restored.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Protocol

from power.runtime.applier import ClockApplier
from power.runtime.loop import PowerLoop
from power.runtime.session import DEFAULT_PROFILE_DIR, open_session
from power.policy.budget import BudgetController
from power.runtime.cap import budget_for, install, status_dict
from power.runtime.meter import rail_power_reader
from power.physics.costmodel import ModelShape
from power.policy.dvfs import PhaseIn
from power.policy.profiles import Profile
from power.runtime.state import STATE_FILE, clear_state, write_state

log = logging.getLogger("orin_agent.power")


class _Event(Protocol):
    kind: str
    t: float
    n_tokens: int
    context: int
    batch: int


class PowerController:
    def __init__(self, loop: PowerLoop, applier: ClockApplier, run_dir: str | os.PathLike[str]) -> None:
        self.loop, self.applier, self.run_dir = loop, applier, run_dir
        self._q: queue.SimpleQueue[PhaseIn | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="power", daemon=True)
        self._stop = threading.Event()
        self.failed: str | None = None
        self._noted = 0     # applier notes (skipped interfaces, clamps) already logged

    @classmethod
    def open(cls, root: str | os.PathLike[str], run_dir: str | os.PathLike[str], profile: str | Profile,
             *, profile_dir: str | None = DEFAULT_PROFILE_DIR, shape: ModelShape | None = None,
             precision: str = "int4", fan_ours: bool = False, power_cap_w: float | None = None) -> "PowerController":
        """The controller of a board session (:func:`power.runtime.session.open_session`). With a model shape
        (the served model's ModelShape) `auto` plans from the cost model; without
        one it falls back to a fixed rule."""
        session = open_session(root, run_dir, profile, shape, profile_dir=profile_dir, precision=precision,
                               fan_ours=fan_ours, power_cap_w=power_cap_w)
        budget = budget_for(session.profile, power_cap_w)     # [budget] / --power-cap: cap the clocks to it
        if budget is not None:
            install(session.loop, budget, rail_power_reader(session.board, budget.rail))
        return cls(session.loop, session.applier, run_dir)

    # -- PhaseListener
    def on_phase(self, event: _Event) -> None:
        self._q.put(PhaseIn(event.kind, event.n_tokens, event.context, max(1, event.batch)))

    def set_profile(self, profile: Profile) -> None:
        self.loop.set_profile(profile)
        self._q.put(None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.applier.restore()
            clear_state(self.run_dir)
        finally:
            if self.applier.writer.journal is not None:
                self.applier.writer.journal.close()

    def _run(self) -> None:
        last_state = 0.0
        while not self._stop.is_set():
            wake = self.loop.next_wake()
            timeout = 1.0 if wake is None else max(0.0, min(1.0, wake - time.monotonic()))
            try:
                ev = self._q.get(timeout=timeout)
            except queue.Empty:
                ev = None
            if self._stop.is_set() or self.failed:
                if self.failed:
                    self._stop.wait(1.0)
                continue
            now = time.monotonic()
            try:
                d = self.loop.on_event(ev, now) if ev is not None else self.loop.tick(now)
            except (OSError, ValueError) as exc:
                self.failed = str(exc)
                log.error("power controller disabled after a write error (board files restored): %s", exc)
                continue
            for line in self.applier.notes[self._noted:]:
                log.warning("%s", line)
            self._noted = len(self.applier.notes)
            if now - last_state >= 1.0:
                last_state = now
                try:
                    write_state(self.run_dir, self.snapshot(d))
                except OSError as exc:
                    log.warning("cannot write %s: %s", STATE_FILE, exc)

    def max_rows(self, engine_max: int) -> int | None:
        """The decode rows the engine may admit now under the power budget (None: no budget, no limit)."""
        ctl = self.loop.controller
        return ctl.max_rows(self.loop.state, engine_max) if isinstance(ctl, BudgetController) else None  # type: ignore[arg-type]

    def budget_status(self) -> dict[str, float | int | bool] | None:
        """The power budget's last status (``/metrics``), None without a budget."""
        return status_dict(self.loop)

    def snapshot(self, d: Any) -> dict[str, Any]:
        v = self.loop.state.verdict
        return {"profile": self.loop.profile.name, "phase": self.loop.phase.kind, "pid": os.getpid(),
                "updated": time.time(), "failed": self.failed, "warnings": list(self.applier.notes),
                "decision": None if d is None else {
                    "phase": d.phase, "gpu_min_hz": d.gpu_min_hz, "gpu_max_hz": d.gpu_max_hz,
                    "emc_hz": d.emc_hz, "cpu_max_khz": d.cpu_max_khz, "fan_pwm": d.fan_pwm,
                    "thermal_level": d.thermal_level, "critical": d.critical, "reason": d.reason},
                "budget": status_dict(self.loop),
                "thermal": None if v is None else {"hottest": v.hottest, "hottest_c": v.hottest_c,
                                                   "target_c": v.target_c, "critical_c": v.critical_c,
                                                   "offline": list(v.offline)},
                "stats": {"events": self.loop.stats.events, "switches": self.loop.stats.switches,
                          "writes": self.loop.stats.writes}}
