"""A stand-in for the kernel's side of sysfs writes, for the board-layer tests.

It enforces what the real files enforce (ORIN.md "write order"): devfreq/cpufreq refuse a minimum
above the current maximum and a maximum below the current minimum (EINVAL); the bpmp EMC ``rate``
is refused unless ``mrq_rate_locked`` is 1. It can deny chosen files (EACCES) and "crash" after a
number of writes by raising :class:`SimulatedCrash` (a BaseException: nothing may catch it, just as
nothing runs after a process is killed).
"""
from __future__ import annotations

import errno
import os

from power.hw.journal import BoardIO

PAIRS = {"min_freq": "max_freq", "max_freq": "min_freq",
         "scaling_min_freq": "scaling_max_freq", "scaling_max_freq": "scaling_min_freq"}


class SimulatedCrash(BaseException):
    pass


class FakeKernel(BoardIO):
    def __init__(self, *, denied: set[str] | None = None, crash_after: int | None = None) -> None:
        self.denied = denied or set()
        self.crash_after = crash_after
        self.writes: list[tuple[str, bytes]] = []

    def write(self, host_path: str, data: bytes, *, create: bool = False) -> None:
        if self.crash_after is not None and len(self.writes) >= self.crash_after:
            raise SimulatedCrash(host_path)
        if host_path in self.denied:
            raise PermissionError(errno.EACCES, "Permission denied", host_path)
        name = os.path.basename(host_path)
        if name in PAIRS and os.path.exists(os.path.join(os.path.dirname(host_path), PAIRS[name])):
            other = int(self.read(os.path.join(os.path.dirname(host_path), PAIRS[name])))
            v = int(data)
            if ("min" in name and v > other) or ("max" in name and v < other):
                raise OSError(errno.EINVAL, "Invalid argument", host_path)
        if name == "rate" and "bpmp" in host_path and int(data) != int(self.read(host_path)):
            locked = os.path.join(os.path.dirname(host_path), "mrq_rate_locked")
            if os.path.exists(locked) and int(self.read(locked)) != 1:
                raise OSError(errno.EINVAL, "Invalid argument (EMC not locked)", host_path)
        super().write(host_path, data, create=create)
        self.writes.append((host_path, data))
