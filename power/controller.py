"""The service's power controller: a :class:`agent.phases.PhaseListener` that runs the pure DVFS and
thermal controllers on its own thread and applies their decisions through the journaled board layer.

``on_phase`` only queues the event (the engine thread must not wait on sysfs); the thread wakes on
events, on the controller's timers (idle hold, 1 s re-checks) and on the sensor period, and writes a
small state file (``<run_dir>/power-state.json``) that ``orin-agent power status`` shows. ``stop()``
puts every changed file back (journal restore). Any write error restores the journal, logs it and
disables the controller: the service keeps serving at the board's own clocks.

Wiring (agent/service.py): ``PowerController.open(root, run_dir, profile)`` and pass it as the
service's ``listener`` (or inside ``FanOut``); call ``start()`` after the engine starts and
``stop()`` before the board is restored.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from power.applier import ClockApplier, PowerLoop, read_zone_samples, tables_from_board
from power.hw.backends import SysfsBoard, open_board
from power.physics.boards import board_for
from power.physics.costmodel import ModelShape
from power.policy.dvfs import DvfsController, PhaseIn, Planner
from power.policy.profiles import DEFAULT_USER_DIR, Profile, ProfileStore

log = logging.getLogger("orin_agent.power")
STATE_FILE = "power-state.json"


class _Event(Protocol):
    kind: str
    t: float
    n_tokens: int
    context: int
    batch: int


def write_state(run_dir: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    path = Path(run_dir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def clear_state(run_dir: str | os.PathLike[str]) -> None:
    """Forget the controller's state once the board is restored: the file must not describe clocks that
    are no longer in force."""
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)


def describe_state(state: dict[str, Any] | None) -> str:
    """One line for people from a state file's content: profile, phase, last decision; '-' when none."""
    if not state:
        return "-"
    d = state.get("decision") or {}
    line = f"profile {state.get('profile')}, phase {state.get('phase')}"
    if d:
        line += (f"; GPU {d.get('gpu_min_hz', 0) / 1e6:.0f}-{d.get('gpu_max_hz', 0) / 1e6:.0f} MHz, "
                 f"EMC {d.get('emc_hz', 0) / 1e6:.0f} MHz, CPU max {d.get('cpu_max_khz', 0) / 1e3:.0f} MHz "
                 f"({d.get('reason')})")
    if state.get("failed"):
        line += f"; FAILED: {state['failed']}"
    return line


def read_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


class PowerController:
    def __init__(self, loop: PowerLoop, applier: ClockApplier, run_dir: str | os.PathLike[str]) -> None:
        self.loop, self.applier, self.run_dir = loop, applier, run_dir
        self._q: queue.SimpleQueue[PhaseIn | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="power", daemon=True)
        self._stop = threading.Event()
        self.failed: str | None = None

    @classmethod
    def open(cls, root: str | os.PathLike[str], run_dir: str | os.PathLike[str], profile: str | Profile,
             *, profile_dir: str | None = DEFAULT_USER_DIR, shape: str | ModelShape | None = None,
             precision: str = "int4", fan_ours: bool = False) -> "PowerController":
        """Board, journal, profile (nvpmodel mode applied), tables and planner for ``root``. With a
        model shape (a preset name or the served model's ModelShape) `auto` plans from the cost model;
        without one it falls back to a fixed rule."""
        prof = profile if isinstance(profile, Profile) else ProfileStore(profile_dir).load(profile)
        board = open_board(root)
        writer = board.writer(run_dir)
        applier = ClockApplier(board, writer)
        spec = None
        ident = board.info.identity
        if ident.board and ident.l4t is not None:
            try:
                spec = board_for(ident.board, ident.l4t.release if ident.l4t.release in ("r35", "r36") else "r36")
            except KeyError:
                spec = None
        try:
            if prof.nvpmodel:
                applier.set_mode(prof.nvpmodel)
                board = SysfsBoard(board.root) if isinstance(board, SysfsBoard) and board.backend == "sysfs" else board
                applier.board = board
            tables = tables_from_board(board, spec.emc_hz if spec else ())
            mode = board.read_mode()
            planner = (Planner.for_board(spec, shape, precision, mode.id if mode else None)
                       if spec is not None and shape else None)
        except Exception:
            applier.restore()
            writer.journal and writer.journal.close()
            raise
        loop = PowerLoop(DvfsController(tables, planner), prof, applier, lambda: read_zone_samples(board),
                         fan_ours=fan_ours)
        return cls(loop, applier, run_dir)

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
            if now - last_state >= 1.0:
                last_state = now
                try:
                    write_state(self.run_dir, self.snapshot(d))
                except OSError as exc:
                    log.warning("cannot write %s: %s", STATE_FILE, exc)

    def snapshot(self, d: Any) -> dict[str, Any]:
        v = self.loop.state.verdict
        return {"profile": self.loop.profile.name, "phase": self.loop.phase.kind, "pid": os.getpid(),
                "updated": time.time(), "failed": self.failed,
                "decision": None if d is None else {
                    "phase": d.phase, "gpu_min_hz": d.gpu_min_hz, "gpu_max_hz": d.gpu_max_hz,
                    "emc_hz": d.emc_hz, "cpu_max_khz": d.cpu_max_khz, "fan_pwm": d.fan_pwm,
                    "thermal_level": d.thermal_level, "critical": d.critical, "reason": d.reason},
                "thermal": None if v is None else {"hottest": v.hottest, "hottest_c": v.hottest_c,
                                                   "target_c": v.target_c, "critical_c": v.critical_c,
                                                   "offline": list(v.offline)},
                "stats": {"events": self.loop.stats.events, "switches": self.loop.stats.switches,
                          "writes": self.loop.stats.writes}}
