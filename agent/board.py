"""The board as the service sees it: readings for /metrics and energy accounting, the twin when
there is no board, and the restore journal's recover-on-start / restore-on-stop.

Everything board-specific goes through `power/` (rooted readers: rails, thermal zones, GPU and EMC
clocks; the twin; the journal); this module only composes them, and degrades to "unavailable" (None)
when a domain is missing, so the service runs on any root.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.phases import PhaseEvent

log = logging.getLogger("orin_agent.board")

TWIN_BOARD = "agx-orin-64gb"
TWIN_L4T = "r36"


@dataclass(frozen=True)
class BoardSnapshot:
    power_mw: float | None  # board total: VDD_IN where measured, else the sum of the rails (power.hw.rails)
    rails_mw: dict[str, float] = field(default_factory=dict)
    temps_c: dict[str, float] = field(default_factory=dict)
    gpu_hz: int | None = None
    emc_hz: int | None = None


class BoardReader:
    """Rooted readings through power/'s readers; any missing domain reads as None."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self.rails: Any = None
        self.thermal: Any = None
        self.gpu: Any = None
        self.emc: Any = None
        try:
            from power.hw.emc import Emc, find_emc
            from power.hw.gpu import GpuClock, find_gpu
            from power.hw.rails import PowerRails, find_rails
            from power.hw.thermal import ThermalZones, find_zones
        except ImportError as exc:  # power/ not installed in this checkout: no readings, no energy
            log.warning("board readings unavailable: %s", exc)
            return
        self.rails = PowerRails(self.root, find_rails(self.root))
        self.thermal = ThermalZones(self.root, find_zones(self.root))
        self.gpu = GpuClock(self.root, find_gpu(self.root))
        self.emc = Emc(self.root, find_emc(self.root))

    @property
    def has_power(self) -> bool:
        return bool(self.rails is not None and self.rails.available)

    def power_mw(self) -> float | None:
        if not self.has_power:
            return None
        return self.rails.total_mw(self.rails.read())

    def snapshot(self) -> BoardSnapshot:
        if self.rails is None:
            return BoardSnapshot(None)
        readings = self.rails.read() if self.rails.available else ()
        rails = {r.label: r.mw for r in readings if r.mw is not None}
        temps = {z.name: z.temp_c for z in self.thermal.read() if z.temp_c is not None} \
            if self.thermal.available else {}
        gpu_hz = self.gpu.read().cur_hz if self.gpu.available else None
        emc_hz = self.emc.read().cur_hz if self.emc.available else None
        return BoardSnapshot(self.rails.total_mw(readings) if readings else None, rails, temps, gpu_hz, emc_hz)


class EnergyMeter:
    """Joules of a step: the board power (sampled at the step's end, averaged with the last sample)
    times the step's wall time. None when the root has no power rails."""

    def __init__(self, reader: BoardReader) -> None:
        self.reader = reader
        self._last_mw: float | None = None

    @property
    def available(self) -> bool:
        return self.reader.has_power

    def step_joules(self, elapsed_s: float) -> float | None:
        mw = self.reader.power_mw()
        if mw is None:
            return None
        avg = mw if self._last_mw is None else (mw + self._last_mw) / 2
        self._last_mw = mw
        return avg / 1000.0 * elapsed_s


# How busy each phase keeps the simulated board (fractions for power.twin's Workload). Estimates:
# prefill is compute-bound (GPU near saturation, DRAM moderate); decode streams the weights and the
# KV-cache (DRAM near saturation, GPU partly idle). The cost model (power/) will replace these.
PHASE_LOAD = {"prefill": (0.95, 0.35), "decode": (0.45, 0.85), "idle": (0.0, 0.0)}


class TwinDriver:
    """Runs the twin's board model in real time next to the engine: every `period_s` it re-reads the
    limits written into the tree, steps the model with the engine's current phase, and flushes the
    readings (rails, temperatures, clocks) that BoardReader then reads like a real board's."""

    def __init__(self, root: Path, period_s: float = 0.05) -> None:
        from power.twin.model import Twin, Workload

        self._Workload = Workload
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
                self.twin.step(now - last, self._Workload(self._phase, gpu, mem))
                self.twin.flush()
            except (OSError, ValueError) as exc:
                log.warning("twin step failed: %s", exc)
            last = now


def is_orin(root: str = "/") -> bool:
    try:
        from power.hw.identity import read_identity
    except ImportError:
        return False
    return read_identity(root).is_orin


def make_twin_root(board: str = TWIN_BOARD, l4t: str = TWIN_L4T) -> Path | None:
    """A fresh twin tree in a temp dir, or None (logged) when power.twin is not available."""
    try:
        from power.twin import create_twin
    except ImportError as exc:
        log.warning("no board root given and this is not an Orin, and the twin is unavailable (%s): "
                    "running without board readings or energy", exc)
        return None
    root = Path(tempfile.mkdtemp(prefix="orin-agent-twin-"))
    create_twin(root, board, l4t)
    log.info("not an Orin and no --root: running on a fresh twin of %s (%s) at %s", board, l4t, root)
    return root


def recover_board(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> int:
    """On start, before anything else: put back what a crashed previous run left changed (its journal
    under run_dir). Returns the number of files restored."""
    from power.hw.journal import Journal

    journal = Journal(run_dir, root, recover=False)
    try:
        n = len(journal.entries)
        if n:
            log.warning("a previous run left %d board file(s) changed (journal in %s): restoring them first",
                        n, run_dir)
            journal.restore()
        return n
    finally:
        journal.close()


def restore_board(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> int:
    """On stop: `orin-agent power restore`'s call. Returns the number of files restored."""
    from power.hw.journal import restore_run_dir

    report = restore_run_dir(run_dir, root)
    return len(report.restored)
