"""EMC (memory clock): bpmp debugfs rate files, the nvpmodel cap and memory-controller activity.

ORIN.md ("EMC"): ``/sys/kernel/debug/bpmp/debug/clk/emc/{rate,min_rate,max_rate,mrq_rate_locked}``;
lock with ``mrq_rate_locked``=1, then write ``rate``; the nvpmodel cap is
``/sys/kernel/nvpmodel_emc_cap/emc_iso_cap`` (r35). r36 kernels name the cap
``/sys/kernel/nvpmodel_clk_cap/emc`` (the ``_KNEXT`` path in NVIDIA's 2023 nvpmodel_p3701_0000.conf and
the path ``nvpmodel -q --verbose`` prints on an r36.4 Orin Nano, both in tests/data). Without
debugfs (containers, locked-down boards) the EMC cannot be pinned; on r36 the agent then caps it
through ``/sys/kernel/nvpmodel_clk_cap/emc`` (ORIN.md field notes), on r35 it leaves the EMC alone.
Activity: ``/sys/kernel/actmon_avg_activity/mc_all`` or ``/sys/kernel/debug/cactmon/mc_all``;
utilisation = mc_all / (rate/1000). Units: Hz.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.errors import FeatureUnavailable
from power.hw.writer import ClockWriter

BPMP_EMC = "/sys/kernel/debug/bpmp/debug/clk/emc"
CAP_R36 = "/sys/kernel/nvpmodel_clk_cap/emc"
CAP_PATHS = ("/sys/kernel/nvpmodel_emc_cap/emc_iso_cap", CAP_R36)
ACTIVITY_PATHS = ("/sys/kernel/actmon_avg_activity/mc_all", "/sys/kernel/debug/cactmon/mc_all")


@dataclass(frozen=True)
class EmcInfo:
    rate: str | None
    min_rate: str | None
    max_rate: str | None
    locked: str | None  # mrq_rate_locked
    cap: str | None  # the first cap file found (r35 name first)
    activity: str | None
    caps: tuple[str, ...] = ()  # every cap file present (an r36 tree can have both names)

    @property
    def available(self) -> bool:
        return self.rate is not None

    @property
    def pinnable(self) -> bool:
        """The rate can be locked (bpmp debugfs rate + mrq_rate_locked)."""
        return self.rate is not None and self.locked is not None

    @property
    def control_cap(self) -> str | None:
        """The cap the agent writes when it cannot pin the rate: r36's clk_cap, only without debugfs."""
        return CAP_R36 if not self.pinnable and CAP_R36 in self.caps else None


@dataclass(frozen=True)
class EmcReading:
    cur_hz: int | None
    min_hz: int | None
    max_hz: int | None
    cap_hz: int | None
    locked: bool | None
    util_pct: float | None


def rate_accept(rate_hz: int) -> tuple[int, int]:
    """Read-backs of an EMC rate write that are BPMP's choice, not a failure: the BPMP rounds to its
    own table (ORIN.md field notes); within a tenth of the rate asked for (an estimate: the T234
    rates in power.physics.boards, 204/665.6/2133/3199 MHz, lie far more than 10 % apart)."""
    return (rate_hz - rate_hz // 10, rate_hz + rate_hz // 10)


def find_emc(root: str | os.PathLike[str]) -> EmcInfo:
    def f(name: str) -> str | None:
        p = f"{BPMP_EMC}/{name}"
        return p if sysfs.is_file(root, p) else None

    caps = tuple(p for p in CAP_PATHS if sysfs.is_file(root, p))
    act = next((p for p in ACTIVITY_PATHS if sysfs.is_file(root, p)), None)
    return EmcInfo(f("rate"), f("min_rate"), f("max_rate"), f("mrq_rate_locked"), caps[0] if caps else None,
                   act, caps)


class Emc:
    group = "emc"

    def __init__(self, root: str | os.PathLike[str], info: EmcInfo) -> None:
        self.root, self.info = root, info

    @property
    def available(self) -> bool:
        return self.info.available

    def writable(self) -> dict[str, str]:
        out = {}
        if self.info.rate and self.info.locked:
            out[self.info.rate] = "EMC rate (Hz), bpmp debugfs"
            out[self.info.locked] = "EMC mrq_rate_locked (0/1), bpmp debugfs"
        elif self.info.control_cap:
            out[self.info.control_cap] = "EMC cap (Hz), nvpmodel clk_cap (no debugfs)"
        return out

    def cap_writable(self) -> dict[str, str]:
        """The nvpmodel EMC cap: written only when nvpmodel is emulated on a twin tree."""
        return {c: "nvpmodel EMC cap (Hz)" for c in self.info.caps}

    def read(self) -> EmcReading:
        r = self.root

        def i(p: str | None) -> int | None:
            return sysfs.read_int(r, p) if p else None

        rate, act, locked = i(self.info.rate), i(self.info.activity), i(self.info.locked)
        util = None
        if rate and act is not None:
            util = 100.0 * act / (rate / 1000.0)
        cap = i(self.info.cap)
        # nvpmodel writes 0 for "no cap" (NVIDIA's 2022 nvpmodel files in tests/data/nvpmodel).
        return EmcReading(rate, i(self.info.min_rate), i(self.info.max_rate), cap if cap and cap > 0 else None,
                          bool(locked) if locked is not None else None, util)

    def lock(self, writer: ClockWriter, rate_hz: int) -> None:
        """Pin the EMC at ``rate_hz``: lock first, then the rate (ORIN.md), as one transaction."""
        if not (self.info.rate and self.info.locked):
            raise FeatureUnavailable(f"EMC clock files are not available under {BPMP_EMC} (debugfs mounted? root?)")
        lo = sysfs.read_int(self.root, self.info.min_rate) if self.info.min_rate else None
        hi = sysfs.read_int(self.root, self.info.max_rate) if self.info.max_rate else None
        if (lo is not None and rate_hz < lo) or (hi is not None and rate_hz > hi):
            raise ValueError(f"EMC rate {rate_hz} Hz is outside [{lo}, {hi}] Hz")
        with writer.transaction():
            writer.write(self.info.locked, 1, group=self.group, role="lock")
            writer.write(self.info.rate, rate_hz, group=self.group, role="rate", accept=rate_accept(rate_hz))

    def cap(self, writer: ClockWriter, rate_hz: int) -> None:
        """Without debugfs on r36: cap the EMC at ``rate_hz`` through nvpmodel's clk_cap file."""
        if not self.info.control_cap:
            raise FeatureUnavailable(f"no EMC cap file the agent may write ({CAP_R36} without debugfs)")
        writer.write(self.info.control_cap, rate_hz, group=self.group, role="cap")

    def unlock(self, writer: ClockWriter) -> None:
        """Hand the EMC back to the BPMP's own scaling."""
        if not self.info.locked:
            raise FeatureUnavailable(f"EMC lock file is not available under {BPMP_EMC}")
        writer.write(self.info.locked, 0, group=self.group, role="lock")
