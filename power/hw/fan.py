"""The fan: PWM duty (0-255) of the pwm-fan hwmon device.

ORIN.md ("fan"): ``/sys/devices/platform/pwm-fan*/hwmon/hwmon*/pwm1`` (0-255). NVIDIA's
``nvfancontrol`` service owns it unless stopped, so a written value may be overwritten within its 2 s
poll (nvfancontrol documentation, r34.1); that is reported, not fought.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.errors import FeatureUnavailable
from power.hw.writer import ClockWriter

PWM_GLOB = "/sys/devices/platform/pwm-fan*/hwmon/hwmon*/pwm1"
PWM_MAX = 255
TACH_GLOB = "/sys/class/hwmon/hwmon*/rpm"   # a hwmon device named like *tach* (r36 carriers)


@dataclass(frozen=True)
class FanInfo:
    pwm: str | None
    rpm: str | None


@dataclass(frozen=True)
class FanReading:
    pwm: int | None

    @property
    def percent(self) -> float | None:
        return None if self.pwm is None else 100.0 * self.pwm / PWM_MAX


def find_fan(root: str | os.PathLike[str]) -> FanInfo:
    hits = sysfs.glob_board(root, PWM_GLOB)
    pwm = hits[0] if hits else None
    rpm = None
    if pwm:
        cand = pwm.rsplit("/", 1)[0] + "/rpm"
        rpm = cand if sysfs.is_file(root, cand) else None
    if rpm is None:     # r36 boards expose the tachometer as a hwmon device of its own
        rpm = next((p for p in sysfs.glob_board(root, TACH_GLOB)
                    if "tach" in (sysfs.read_text(root, p.rsplit("/", 1)[0] + "/name") or "")), None)
    return FanInfo(pwm, rpm)


class Fan:
    group = "fan"

    def __init__(self, root: str | os.PathLike[str], info: FanInfo) -> None:
        self.root, self.info = root, info

    @property
    def available(self) -> bool:
        return self.info.pwm is not None

    def writable(self) -> dict[str, str]:
        return {self.info.pwm: "fan pwm1 (0-255)"} if self.info.pwm else {}

    def read(self) -> FanReading:
        return FanReading(sysfs.read_int(self.root, self.info.pwm) if self.info.pwm else None)

    def set_pwm(self, writer: ClockWriter, pwm: int) -> None:
        if not self.info.pwm:
            raise FeatureUnavailable("this board has no pwm-fan")
        if not 0 <= pwm <= PWM_MAX:
            raise ValueError(f"fan PWM must be 0-{PWM_MAX}, got {pwm}")
        writer.write(self.info.pwm, pwm, group=self.group, role="pwm")
