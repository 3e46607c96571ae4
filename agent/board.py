"""The board as the service sees it: readings for /metrics and energy accounting, the twin when there
is no board, and the restore journal's recover-on-start / restore-on-stop.

Everything board-specific is in ``power``: readings come from the board power.hw.backends.open_board
opens (the same factory, sysfs or jtop, the power controller uses), the twin from power.twin (its real-
time driver is power.twin.driver.TwinDriver), the journal from power.hw.journal. This module composes
them and degrades to "unavailable" (None) when a domain is missing, so the service runs on any root.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from power.hw.backends import SysfsBoard, open_board
from power.hw.identity import read_identity
from power.hw.journal import Journal, restore_run_dir
from power.twin import create_twin
from power.twin.driver import PHASE_LOAD, TwinDriver

__all__ = ["PHASE_LOAD", "TWIN_BOARD", "TWIN_L4T", "BoardReader", "BoardSnapshot", "EnergyMeter", "TwinDriver",
           "is_orin", "make_twin_root", "recover_board", "restore_board"]

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
    """Rooted readings through the board power's factory opens; any missing domain reads as None."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self.board: SysfsBoard = open_board(self.root)
        self.rails = self.board.rails
        self.thermal = self.board.thermal
        self.gpu = self.board.gpu
        self.emc = self.board.emc

    @property
    def has_power(self) -> bool:
        return bool(self.rails.available)

    def power_mw(self) -> float | None:
        if not self.has_power:
            return None
        return self.rails.total_mw(self.board.read_rails())

    def snapshot(self) -> BoardSnapshot:
        readings = self.board.read_rails() if self.rails.available else ()
        rails = {r.label: r.mw for r in readings if r.mw is not None}
        temps = {z.name: z.temp_c for z in self.board.read_zones() if z.temp_c is not None} \
            if self.thermal.available else {}
        gpu_hz = self.gpu.read().cur_hz if self.gpu.available else None
        emc_hz = self.emc.read().cur_hz if self.emc.available else None
        return BoardSnapshot(self.rails.total_mw(readings) if readings else None, rails, temps, gpu_hz, emc_hz)

    def close(self) -> None:
        self.board.close()


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


def is_orin(root: str = "/") -> bool:
    return read_identity(root).is_orin


def make_twin_root(board: str = TWIN_BOARD, l4t: str = TWIN_L4T) -> Path:
    """A fresh twin tree in a temp dir."""
    root = Path(tempfile.mkdtemp(prefix="orin-agent-twin-"))
    create_twin(root, board, l4t)
    log.info("not an Orin and no --root: running on a fresh twin of %s (%s) at %s", board, l4t, root)
    return root


def recover_board(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> int:
    """On start, before anything else: put back what a crashed previous run left changed (its journal
    under run_dir). Returns the number of files restored."""
    journal = Journal(run_dir, root, recover=False)
    try:
        if journal.stale_temps:
            log.warning("removed %d temp file(s) a killed write left: %s", len(journal.stale_temps),
                        ", ".join(journal.stale_temps))
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
    report = restore_run_dir(run_dir, root)
    return len(report.restored)
