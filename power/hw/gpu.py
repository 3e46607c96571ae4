"""GPU clock (devfreq), load and rail-gating: discovery, readings and the min/max setter.

Discovery follows ORIN.md ("GPU devfreq"): the ``/sys/class/devfreq/*`` entry whose
``device/of_node/compatible`` contains ``nvidia,ga10b`` (or whose ``device/of_node/name`` is
``gpu``/``ga10b``); then the known r35 and r36 locations. Units: Hz; load is per-mille (0-1000).
"""
from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.errors import FeatureUnavailable
from power.hw.writer import ClockWriter
from power.hw.tables import snap

DEVFREQ_CLASS = "/sys/class/devfreq"
GA10B_COMPATIBLE = "nvidia,ga10b"
OF_NODE_NAMES = ("gpu", "ga10b")
# ORIN.md "GPU devfreq": r35 (two places), then r36.
FALLBACK_DEVFREQ = (
    "/sys/devices/17000000.ga10b/devfreq/17000000.ga10b",
    "/sys/devices/gpu.0/devfreq/17000000.ga10b",
    "/sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu",
    "/sys/devices/platform/17000000.gpu/devfreq_dev",   # r36 nvpmodel's _KNEXT path (ORIN.md field notes)
)
# ORIN.md "GPU load" / "GPU rail-gating": r35, then the two r36 places.
GPU_DEVICE_DIRS = (
    "/sys/devices/gpu.0",
    "/sys/devices/platform/gpu.0",
    "/sys/devices/platform/bus@0/17000000.gpu",
    "/sys/devices/platform/17000000.gpu",
)


@dataclass(frozen=True)
class GpuInfo:
    devfreq: str | None  # board path of the devfreq directory
    found_by: str  # how discovery found it (for `power status` and bug reports)
    available_hz: tuple[int, ...]
    load: str | None
    railgate: str | None
    tpc_pg_mask: str | None

    def file(self, name: str) -> str | None:
        return posixpath.join(self.devfreq, name) if self.devfreq else None


@dataclass(frozen=True)
class GpuReading:
    cur_hz: int | None
    min_hz: int | None
    max_hz: int | None
    governor: str | None
    load_pct: float | None
    railgate: bool | None


def _is_gpu_node(root: str | os.PathLike[str], entry: str) -> bool:
    compat = sysfs.read_bytes(root, f"{entry}/device/of_node/compatible")
    if compat is not None and GA10B_COMPATIBLE.encode() in compat:
        return True
    name = sysfs.read_text(root, f"{entry}/device/of_node/name")
    return name in OF_NODE_NAMES


def find_gpu(root: str | os.PathLike[str]) -> GpuInfo:
    devfreq, how = None, "not found"
    for name in sysfs.listdir(root, DEVFREQ_CLASS):
        entry = f"{DEVFREQ_CLASS}/{name}"
        if _is_gpu_node(root, entry) and sysfs.is_file(root, f"{entry}/max_freq"):
            devfreq, how = entry, "devfreq class, of_node match"
            break
    if devfreq is None:
        for cand in FALLBACK_DEVFREQ:
            if sysfs.is_file(root, f"{cand}/max_freq"):
                devfreq, how = cand, "known path"
                break
    if devfreq is not None:
        # Keep the device path rather than the class link: it is what the journal names.
        devfreq = sysfs.to_board(root, sysfs.resolve(root, devfreq))
    dev_dirs = ([f"{devfreq}/device"] if devfreq else []) + list(GPU_DEVICE_DIRS)

    def first(name: str) -> str | None:
        for d in dev_dirs:
            if sysfs.is_file(root, f"{d}/{name}"):
                return sysfs.to_board(root, sysfs.resolve(root, f"{d}/{name}"))
        return None

    avail = tuple(sorted(sysfs.read_ints(root, f"{devfreq}/available_frequencies"))) if devfreq else ()
    return GpuInfo(devfreq, how, avail, first("load"), first("railgate_enable"), first("tpc_pg_mask"))


class GpuClock:
    """The GPU's devfreq node. Setting min/max goes through a :class:`ClockWriter`."""

    group = "gpu"

    def __init__(self, root: str | os.PathLike[str], info: GpuInfo) -> None:
        self.root, self.info = root, info

    @property
    def available(self) -> bool:
        return self.info.devfreq is not None

    def writable(self) -> dict[str, str]:
        out = {}
        if self.info.devfreq:
            out[f"{self.info.devfreq}/min_freq"] = "GPU devfreq min_freq (Hz)"
            out[f"{self.info.devfreq}/max_freq"] = "GPU devfreq max_freq (Hz)"
        return out

    def read(self) -> GpuReading:
        r, f = self.root, self.info.file
        load = sysfs.read_int(r, self.info.load) if self.info.load else None
        gate = sysfs.read_int(r, self.info.railgate) if self.info.railgate else None
        return GpuReading(
            sysfs.read_int(r, f("cur_freq")) if f("cur_freq") else None,
            sysfs.read_int(r, f("min_freq")) if f("min_freq") else None,
            sysfs.read_int(r, f("max_freq")) if f("max_freq") else None,
            sysfs.read_text(r, f("governor")) if f("governor") else None,
            load / 10.0 if load is not None else None,  # per-mille -> percent
            bool(gate) if gate is not None else None,
        )

    def set_range(self, writer: ClockWriter, min_hz: int, max_hz: int) -> tuple[int, int]:
        """Clamp the GPU clock to [min_hz, max_hz], snapped to available frequencies."""
        if not self.info.devfreq:
            raise FeatureUnavailable("this board has no GPU devfreq node (the GPU may not have powered up yet)")
        lo = snap(self.info.available_hz, min_hz, up=True)
        hi = snap(self.info.available_hz, max_hz, up=False)
        if lo > hi:
            raise ValueError(f"GPU: no available frequency in [{min_hz}, {max_hz}] Hz "
                             f"(available: {', '.join(map(str, self.info.available_hz))})")
        writer.write_range(f"{self.info.devfreq}/min_freq", f"{self.info.devfreq}/max_freq", lo, hi,
                           group=self.group)
        return lo, hi
