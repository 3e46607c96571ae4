"""Clock tables and snapping: the tables the controller picks from (GPU/EMC in Hz, CPU in kHz) with the
power mode's caps, and the one helper that snaps a wanted frequency onto a table. Used by the hardware
setters (a min snaps up, a max down), the equations, the policy and the twin; the lowest layer that needs
them is this one, so they live here.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass


def snap(table: tuple[int, ...], want: float, *, up: bool, slack: float = 0.0) -> int:
    """The entry of an ascending ``table`` nearest ``want``: the smallest at or above it with ``up`` (a
    minimum: a request never widens the range it asked for; the top entry if none), else the largest
    at or below it (a maximum; the bottom entry if none). ``slack`` forgives float rounding (0.5 for
    values computed from fractions). An empty table gives ``want`` back."""
    if not table:
        return int(want)
    if up:
        return table[min(bisect_left(table, want - slack), len(table) - 1)]
    return table[max(bisect_right(table, want + slack) - 1, 0)]


@dataclass(frozen=True)
class BoardTables:
    """The clock tables the controller picks from (read from the device or the twin's spec) and the
    caps of the power mode in force. CPU in kHz, GPU/EMC in Hz."""
    gpu_hz: tuple[int, ...]
    emc_hz: tuple[int, ...]
    cpu_khz: tuple[int, ...]
    gpu_cap_hz: int | None = None
    emc_cap_hz: int | None = None
    cpu_cap_khz: int | None = None

    @property
    def gpu_top(self) -> int:
        return max(f for f in self.gpu_hz if f <= (self.gpu_cap_hz or self.gpu_hz[-1])) \
            if self.gpu_hz[0] <= (self.gpu_cap_hz or self.gpu_hz[-1]) else self.gpu_hz[0]

    @property
    def emc_top(self) -> int:
        cap = self.emc_cap_hz or self.emc_hz[-1]
        return max([f for f in self.emc_hz if f <= cap] or [self.emc_hz[0]])

    @property
    def cpu_top(self) -> int:
        cap = self.cpu_cap_khz or self.cpu_khz[-1]
        return max([f for f in self.cpu_khz if f <= cap] or [self.cpu_khz[0]])
