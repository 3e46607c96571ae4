"""The twin driven in real time next to a running engine: every period it re-reads the limits written
into the tree, steps the board model with the engine's current phase and flushes the readings (rails,
temperatures, clocks) that the service then reads like a real board's. The service's listener for
phase events when it runs on a twin.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from power.physics.equations import Workload
from power.twin.model import Twin

log = logging.getLogger("orin_agent.board")


class _PhaseEvent(Protocol):
    kind: str


# How busy each phase keeps the simulated board (fractions for the Workload). Estimates:
# prefill is compute-bound (GPU near saturation, DRAM moderate); decode streams the weights and the
# KV-cache (DRAM near saturation, GPU partly idle). Estimates; the energy benchmark uses the cost model instead.
PHASE_LOAD = {"prefill": (0.95, 0.35), "decode": (0.45, 0.85), "idle": (0.0, 0.0)}


class TwinDriver:
    """Runs the twin's board model in real time next to the engine: every `period_s` it re-reads the
    limits written into the tree, steps the model with the engine's current phase, and flushes the
    readings (rails, temperatures, clocks) that BoardReader then reads like a real board's."""

    def __init__(self, root: Path, period_s: float = 0.05) -> None:
        self.twin = Twin(root, atomic_writes=True)
        self.root, self.period_s = root, period_s
        self._phase = "idle"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twin", daemon=True)

    def on_phase(self, event: _PhaseEvent) -> None:
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
