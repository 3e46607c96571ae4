"""The twin driven in real time next to a running engine: every period it re-reads the limits written
into the tree, steps the board model with the engine's current phase and flushes the readings (rails,
temperatures, clocks) that the service then reads like a real board's. The service's listener for
phase events when it runs on a twin (a :class:`power.policy.phase.PhaseListener`).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from power.physics.equations import Workload
from power.policy.phase import PhaseEvent, PhaseListener
from power.twin.model import Twin

log = logging.getLogger("orin_agent.board")


# How busy each phase keeps the simulated board (fractions for the Workload). Estimates:
# prefill is compute-bound (GPU near saturation, DRAM moderate); decode streams the weights and the
# KV-cache (DRAM near saturation, GPU partly idle). Estimates; the energy benchmark uses the cost model instead.
PHASE_LOAD = {"prefill": (0.95, 0.35), "decode": (0.45, 0.85), "idle": (0.0, 0.0)}


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every plain file under ``root`` (relative path -> content): a snapshot to compare a tree with."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def reading_files(scratch: Path, board: str = "agx-orin-64gb", l4t: str = "r36") -> set[str]:
    """The files the twin's own model rewrites as readings (clocks it reports, loads, rails, temperatures,
    the fan daemon's PWM), found by stepping a fresh twin under ``scratch`` through every phase: on a real
    board these change by themselves too, so "the tree is back as it was" is about every other file."""
    from power.twin.layout import create_twin

    root = scratch / "readings-twin"
    create_twin(root, board, l4t)
    before = tree_bytes(root)
    twin, changed = Twin(root, atomic_writes=True), set()
    for phase in ("prefill", "decode", "idle"):
        for _ in range(30):
            twin.step(1.0, Workload(phase, *PHASE_LOAD[phase]))
            twin.flush()
        now = tree_bytes(root)
        changed |= {k for k in set(before) | set(now) if before.get(k) != now.get(k)}
    return changed


class TwinDriver(PhaseListener):
    """Runs the twin's board model in real time next to the engine: every `period_s` it re-reads the
    limits written into the tree, steps the model with the engine's current phase, and flushes the
    readings (rails, temperatures, clocks) that the board meter (power.runtime.meter) then reads like a
    real board's."""

    def __init__(self, root: Path, period_s: float = 0.05) -> None:
        self.twin = Twin(root, atomic_writes=True)
        self.root, self.period_s = root, period_s
        self._phase = "idle"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twin", daemon=True)

    def on_phase(self, event: PhaseEvent) -> None:
        self._phase = event.kind

    def start(self) -> None:
        self.twin.flush()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            gpu, mem = PHASE_LOAD.get(self._phase, (0.0, 0.0))
            try:
                self.twin.read_limits()
                self.twin.step(now - last, Workload(self._phase, gpu, mem))
                self.twin.flush()
            except (OSError, ValueError) as exc:
                log.warning("twin step failed: %s", exc)
            last = now
