"""Thermal zones: names across L4T layouts, temperatures and trip points.

ORIN.md ("thermal"): ``/sys/class/thermal/thermal_zone*/{type,temp,trip_point_*_temp,
trip_point_*_type,trip_point_*_hyst}`` in m°C. r35 names zones ``CPU-therm GPU-therm ... tj-therm``,
r36 ``cpu-thermal gpu-thermal ... tj-thermal``; both map to one canonical name (``cpu``, ``tj``...).
A zone that cannot be read is offline (``None``), never 0 °C; tegrastats prints such zones as
-256C (captured r35 AGX line in tests/data), so that sentinel is offline too.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from power.hw import sysfs

THERMAL_CLASS = "/sys/class/thermal"
OFFLINE_MILLI_C = -256000


@dataclass(frozen=True)
class TripPoint:
    index: int
    type: str | None  # "passive", "active", "hot", "critical"
    temp_c: float | None
    hyst_c: float | None


@dataclass(frozen=True)
class ZoneInfo:
    path: str
    type: str  # as the kernel names it: "CPU-therm" or "cpu-thermal"
    name: str  # canonical: "cpu"


@dataclass(frozen=True)
class ZoneReading:
    name: str
    type: str
    temp_c: float | None  # None = offline
    trips: tuple[TripPoint, ...]

    @property
    def online(self) -> bool:
        return self.temp_c is not None


def canonical_zone_name(zone_type: str) -> str:
    """``CPU-therm`` / ``cpu-thermal`` -> ``cpu``; ``Tboard_tegra`` stays lower-cased."""
    t = zone_type.strip().lower()
    return re.sub(r"[-_](thermal|therm)$", "", t)


def _milli_c(v: int | None) -> float | None:
    if v is None or v <= OFFLINE_MILLI_C:
        return None
    return v / 1000.0


def find_zones(root: str | os.PathLike[str]) -> tuple[ZoneInfo, ...]:
    zones = []
    names = [n for n in sysfs.listdir(root, THERMAL_CLASS) if n.startswith("thermal_zone")]
    for n in sorted(names, key=sysfs.natural_key):
        path = f"{THERMAL_CLASS}/{n}"
        ztype = sysfs.read_text(root, f"{path}/type")
        if ztype:
            zones.append(ZoneInfo(path, ztype, canonical_zone_name(ztype)))
    return tuple(zones)


def read_trips(root: str | os.PathLike[str], zone: str) -> tuple[TripPoint, ...]:
    idx = sorted({int(m.group(1)) for n in sysfs.listdir(root, zone)
                  if (m := re.fullmatch(r"trip_point_(\d+)_temp", n))})
    return tuple(TripPoint(i, sysfs.read_text(root, f"{zone}/trip_point_{i}_type"),
                           _milli_c(sysfs.read_int(root, f"{zone}/trip_point_{i}_temp")),
                           _milli_c(sysfs.read_int(root, f"{zone}/trip_point_{i}_hyst")))
                 for i in idx)


class ThermalZones:
    def __init__(self, root: str | os.PathLike[str], zones: tuple[ZoneInfo, ...]) -> None:
        self.root, self.zones = root, zones

    @property
    def available(self) -> bool:
        return bool(self.zones)

    def read(self) -> tuple[ZoneReading, ...]:
        return tuple(ZoneReading(z.name, z.type, _milli_c(sysfs.read_int(self.root, f"{z.path}/temp")),
                                 read_trips(self.root, z.path)) for z in self.zones)

    def temp_c(self, name: str) -> float | None:
        """Temperature of a zone by canonical name (``tj``); ``None`` if absent or offline."""
        for z in self.zones:
            if z.name == name:
                return _milli_c(sysfs.read_int(self.root, f"{z.path}/temp"))
        return None
