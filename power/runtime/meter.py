"""The board meter: the one reader of a board's rails, clocks and temperatures in a process.

Its owner's thread calls :meth:`BoardMeter.sample` (the service's power thread, power.runtime.controller,
on every phase event and timer wake, right before the power loop decides); everyone else reads what the
last sample kept and never touches sysfs: the engine a step's joules (:meth:`step_joules`, on the engine
thread), the power budget its rail (:meth:`reader`), /metrics and the demo the last
:class:`BoardSnapshot`.

Board power is the board total of power.hw.rails (the VDD_IN rail where the board has one, Orin NX/Nano:
the module's input; else the sum of the rails, AGX Orin: VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 +
VDDQ_VDD2_1V8AO); a budget may name one INA3221 rail instead.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from power.hw.backends import SysfsBoard
from power.hw.rails import PowerRails, RailReading

SENSOR_PERIOD_S = 1.0   # temperatures at most once a second (the power loop's own sensor period)


@dataclass(frozen=True)
class BoardSnapshot:
    power_mw: float | None  # board total: VDD_IN where measured, else the sum of the rails (power.hw.rails)
    rails_mw: dict[str, float] = field(default_factory=dict)
    temps_c: dict[str, float] = field(default_factory=dict)
    gpu_hz: int | None = None       # the clocks running (cur_freq / the EMC rate)
    emc_hz: int | None = None
    gpu_max_hz: int | None = None   # the GPU's max limit in force (devfreq max_freq)
    t: float = float("-inf")        # when it was taken (time.monotonic(), the engine's phase events' clock)


class PowerSource(Protocol):
    """Where a budget reads its power: :class:`BoardMeter` on a board, the twin's state in virtual time."""

    def reader(self, rail: str | None) -> Callable[[], float | None]: ...


class BoardMeter:
    """Samples one board (any domain it lacks reads as None) and keeps the last sample for every reader."""

    def __init__(self, board: SysfsBoard, zones_period_s: float = SENSOR_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.board, self.zones_period_s, self._clock = board, zones_period_s, clock
        self._lock = threading.Lock()
        self._rails: tuple[RailReading, ...] = ()
        self._watts: tuple[float | None, float | None] = (None, None)     # board power: the last two samples
        self._snap = BoardSnapshot(None)
        self._zones_t = float("-inf")

    @property
    def available(self) -> bool:
        """The board has power rails (else every step's energy is None)."""
        return bool(self.board.rails.available)

    def sample(self, now: float | None = None) -> BoardSnapshot:
        """Read the rails and the GPU / EMC clocks now, the thermal zones at most every ``zones_period_s``.
        The only call that reads the board: its owner's thread makes it."""
        now = self._clock() if now is None else now
        b = self.board
        rails = b.read_rails() if b.rails.available else ()
        total = PowerRails.total_mw(rails) if rails else None
        gpu = b.gpu.read() if b.gpu.available else None
        emc_hz = b.emc.read().cur_hz if b.emc.available else None
        temps = self._snap.temps_c
        if now - self._zones_t >= self.zones_period_s:
            self._zones_t = now
            temps = {z.name: z.temp_c for z in b.read_zones() if z.temp_c is not None} if b.thermal.available else {}
        snap = BoardSnapshot(total, {r.label: r.mw for r in rails if r.mw is not None}, temps,
                             gpu.cur_hz if gpu else None, emc_hz, gpu.max_hz if gpu else None, now)
        with self._lock:
            self._rails, self._snap = rails, snap
            self._watts = (None if total is None else total / 1000.0, self._watts[0])
        return snap

    def snapshot(self) -> BoardSnapshot:
        """The last sample (what /metrics shows)."""
        with self._lock:
            return self._snap

    def power_w(self, rail: str | None = None) -> float | None:
        """The last sample's board power (``rail`` None) or that rail's, W; None when unread."""
        with self._lock:
            if rail is None:
                return self._watts[0]
            mw = next((r.mw for r in self._rails if r.label == rail), None)
        return None if mw is None else mw / 1000.0

    def reader(self, rail: str | None) -> Callable[[], float | None]:
        """A budget's power input: the last sample's board power, or ``rail``'s (ValueError naming the board's
        rails when it has no such label; read once here, on the opener's thread)."""
        if rail is not None:
            labels = [r.label for r in self.board.read_rails() if r.label and r.label != "NC"]
            if rail not in labels:
                raise ValueError(f"budget rail {rail!r}: this board's rails are {', '.join(labels) or 'none readable'} "
                                 f"(leave rail out to budget module power)")
        return lambda: self.power_w(rail)

    def step_joules(self, elapsed_s: float) -> float | None:
        """Joules of a step that took ``elapsed_s``: the mean of the last two samples' board power times
        the step's time (None without power rails). Reads no file: the engine thread calls it."""
        with self._lock:
            last, prev = self._watts
        if last is None:
            return None
        return (last if prev is None else (last + prev) / 2) * elapsed_s
