"""Power rails: the INA3221 monitors' labelled channels, and the board total.

ORIN.md ("power rails"): INA3221 at ``/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon*/`` (AGX:
``VDD_GPU_SOC``, ``VDD_CPU_CV``, ``VIN_SYS_5V0``; at ``1-0041``: ``VDDQ_VDD2_1V8AO``; NX/Nano at
``1-0040``: ``VDD_IN``, ``VDD_CPU_GPU_CV``, ``VDD_SOC``). ``inN_input`` mV, ``currN_input`` mA,
``currN_crit`` mA; power = mV x mA / 1000 mW. Channels labelled ``NC`` and the sum-of-shunts channel
are skipped. The total is ``VDD_IN`` where the board measures it (NX/Nano: the module input), else the
sum of the measured rails (AGX has no input rail; jetson-stats documents the same rule).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from power.hw import sysfs

INA3221_DRIVER = "/sys/bus/i2c/drivers/ina3221"
TOTAL_RAIL = "VDD_IN"
# The INA3221 has three channels; the upstream driver exposes their summed shunt as a 4th/7th input.
MAX_CHANNEL = 3


@dataclass(frozen=True)
class RailInfo:
    label: str
    device: str  # "1-0040"
    hwmon: str  # board path of the hwmon directory
    channel: int


@dataclass(frozen=True)
class RailReading:
    label: str
    mv: int | None
    ma: int | None
    crit_ma: int | None

    @property
    def mw(self) -> float | None:
        if self.mv is None or self.ma is None:
            return None
        return self.mv * self.ma / 1000.0


def _skip(label: str) -> bool:
    lab = label.strip().upper()
    return lab == "NC" or "SUM" in lab


def find_rails(root: str | os.PathLike[str]) -> tuple[RailInfo, ...]:
    rails = []
    for dev in sysfs.listdir(root, INA3221_DRIVER):
        if not re.fullmatch(r"\d+-[0-9a-fA-F]{4}", dev):
            continue
        for hw in sysfs.glob_board(root, f"{INA3221_DRIVER}/{dev}/hwmon/hwmon*"):
            for name in sysfs.listdir(root, hw):
                m = re.fullmatch(r"in(\d+)_label", name)
                if not m or int(m.group(1)) > MAX_CHANNEL:
                    continue
                ch = int(m.group(1))
                label = sysfs.read_text(root, f"{hw}/{name}")
                if not label or _skip(label) or not sysfs.is_file(root, f"{hw}/in{ch}_input"):
                    continue
                rails.append(RailInfo(label, dev, hw, ch))
    return tuple(sorted(rails, key=lambda r: (r.device, r.channel)))


class PowerRails:
    def __init__(self, root: str | os.PathLike[str], rails: tuple[RailInfo, ...]) -> None:
        self.root, self.rails = root, rails

    @property
    def available(self) -> bool:
        return bool(self.rails)

    def read(self) -> tuple[RailReading, ...]:
        r = self.root
        return tuple(RailReading(x.label, sysfs.read_int(r, f"{x.hwmon}/in{x.channel}_input"),
                                 sysfs.read_int(r, f"{x.hwmon}/curr{x.channel}_input"),
                                 sysfs.read_int(r, f"{x.hwmon}/curr{x.channel}_crit")) for x in self.rails)

    @staticmethod
    def total_mw(readings: tuple[RailReading, ...]) -> float | None:
        for x in readings:
            if x.label == TOTAL_RAIL:
                return x.mw
        vals = [x.mw for x in readings if x.mw is not None]
        return sum(vals) if vals else None
