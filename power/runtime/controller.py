"""The service's power thread: the process's one board session. A
:class:`power.policy.phase.PhaseListener` that meters the board for everyone and, with a control session,
runs the pure DVFS, thermal and budget controllers and applies their decisions through the journaled
board layer.

``on_phase`` only queues the event (the engine thread never waits on sysfs); the thread wakes on events,
on the controller's timers (idle hold, 1 s re-checks), on the sensor period and, while the engine runs,
every ``BUSY_PERIOD_S``. At each wake it samples
the board meter (power.runtime.meter: the one reader of the rails, whose last sample gives the engine its
joules per step, the budget its power and /metrics its readings), then lets the loop decide, and once a
second writes a small state file (``<run_dir>/power-state.json``) that ``orin-agent power status``
shows. ``max_rows`` hands the budget's batch limit back to the scheduler through the same listener.
``stop()`` puts every changed file back (journal restore). Any write error restores the journal, logs it
and disables control (the meter keeps sampling): the service keeps serving at the board's own clocks.

Wiring (agent/service.py): ``PowerController.open(root, run_dir, profile, ...)`` (control) or
``PowerController.metering(root)`` (readings only: power control off, or a board it cannot drive), pass
it as the engine's listener (inside ``FanOut``), its ``meter`` as the engine's energy meter; call
``start()`` after the engine starts and ``stop()`` before the board is restored.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from power.physics.costmodel import ModelShape
from power.policy.dvfs import Decision
from power.policy.phase import PhaseEvent, PhaseListener
from power.policy.profiles import Profile
from power.runtime.board import open_board_at
from power.runtime.cap import status_dict
from power.runtime.meter import SENSOR_PERIOD_S, BoardMeter
from power.runtime.session import DEFAULT_PROFILE_DIR, Session, open_session
from power.runtime.state import STATE_FILE, clear_state, write_state

log = logging.getLogger("orin_agent.power")

# While the engine runs, the meter samples at least this often, so a step's joules come from samples of its
# own phase (a prefill right after idle too): the twin's model rewrites its readings every 50 ms
# (power.twin.driver), and the real-time benchmark samples at the same period.
BUSY_PERIOD_S = 0.05


class PowerController(PhaseListener):
    def __init__(self, meter: BoardMeter, session: Session | None, run_dir: str | os.PathLike[str] | None,
                 period_s: float = SENSOR_PERIOD_S) -> None:
        # period_s: the longest the thread sleeps without an event, and the meter's temperature period
        self.meter, self.session, self.run_dir, self.period_s = meter, session, run_dir, period_s
        meter.zones_period_s = period_s
        self.loop = session.loop if session is not None else None
        self.applier = session.applier if session is not None else None
        self._q: queue.SimpleQueue[PhaseEvent | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="power", daemon=True)
        self._stop = threading.Event()
        self.failed: str | None = None
        self._noted = 0     # applier notes (skipped interfaces, clamps) already logged
        meter.sample()      # a first sample before the engine's first step asks for one

    @classmethod
    def open(cls, root: str | os.PathLike[str], run_dir: str | os.PathLike[str], profile: str | Profile,
             *, profile_dir: str | None = DEFAULT_PROFILE_DIR, shape: ModelShape | None = None,
             precision: str = "int4", fan_ours: bool = False, power_cap_w: float | None = None,
             period_s: float = SENSOR_PERIOD_S) -> "PowerController":
        """The controller of a board session (:func:`power.runtime.session.open_session`, which applies the
        power cap and installs the budget). With a model shape (the served model's) `auto` plans from the
        cost model; without one it falls back to a fixed rule. ``period_s``: see :func:`metering`."""
        session = open_session(root, run_dir, profile, shape, profile_dir=profile_dir, precision=precision,
                               fan_ours=fan_ours, power_cap_w=power_cap_w)
        return cls(session.meter, session, run_dir, period_s)

    @classmethod
    def metering(cls, root: str | os.PathLike[str], period_s: float = SENSOR_PERIOD_S) -> "PowerController":
        """Readings only (energy, /metrics): the board's own clocks, nothing written. The meter samples at
        every phase event and at least every ``period_s`` (the real-time benchmark asks for 50 ms)."""
        return cls(BoardMeter(open_board_at(root)), None, None, period_s)

    # -- the listener (engine thread: never blocks)
    def on_phase(self, event: PhaseEvent) -> None:
        self._q.put(event)

    def max_rows(self, engine_max: int) -> int | None:
        """The decode rows the engine may admit now under the power budget (None: no budget, no limit)."""
        return self.loop.max_rows(engine_max) if self.loop is not None else None

    def set_profile(self, profile: Profile) -> None:
        if self.loop is not None:
            self.loop.set_profile(profile)
        self._q.put(None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.session is not None:
            try:
                self.session.applier.restore()
                if self.run_dir is not None:
                    clear_state(self.run_dir)
            finally:
                self.session.close()
        self.meter.board.close()

    # -- the power thread
    def _run(self) -> None:
        last_state = last_loop = 0.0
        busy = False
        while not self._stop.is_set():
            now = time.monotonic()
            due = self.loop.next_wake() if self.loop is not None and not self.failed else None
            period = min(self.period_s, BUSY_PERIOD_S) if busy else self.period_s
            wait = period if due is None else min(period, due - now)
            try:
                ev = self._q.get(timeout=max(0.0, wait))
            except queue.Empty:
                ev = None
            if self._stop.is_set():
                continue
            now = time.monotonic()
            if ev is not None:
                busy = ev.kind != "idle"
            self.meter.sample(now)      # the one read of the rails: energy, /metrics and the budget use it
            if self.loop is None or self.failed:
                continue
            if ev is None and not ((due is not None and now >= due - 1e-3) or now - last_loop >= self.period_s):
                continue                # a sampling wake only: nothing is due for the loop
            last_loop = now
            try:
                d = self.loop.on_event(ev, now) if ev is not None else self.loop.tick(now)
            except (OSError, ValueError) as exc:
                self.failed = str(exc)
                log.error("power controller disabled after a write error (board files restored): %s", exc)
                continue
            assert self.applier is not None
            for line in self.applier.notes[self._noted:]:
                log.warning("%s", line)
            self._noted = len(self.applier.notes)
            if now - last_state >= 1.0 and self.run_dir is not None:
                last_state = now
                try:
                    write_state(self.run_dir, self.snapshot(d))
                except OSError as exc:
                    log.warning("cannot write %s: %s", STATE_FILE, exc)

    def budget_status(self) -> dict[str, float | int | bool] | None:
        """The power budget's last status (``/metrics``), None without a budget."""
        return status_dict(self.loop) if self.loop is not None else None

    def snapshot(self, d: Decision | None) -> dict[str, Any]:
        """The state file's content (the controller's profile, phase, last decision, budget, thermal state)."""
        assert self.loop is not None and self.applier is not None, "a metering-only controller has no state"
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
