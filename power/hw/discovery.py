"""Discovery: what this root's board has, domain by domain, and what it lacks.

One call, :func:`discover`, asks each domain module to find its files under the root and collects
the answers in a frozen :class:`BoardInfo`. Nothing here raises for a missing file: a missing file
means the feature is unavailable here, and :attr:`BoardInfo.unavailable` says which and why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.cpu import CpuInfo, find_cpus
from power.hw.emc import BPMP_EMC, EmcInfo, find_emc
from power.hw.fan import PWM_GLOB, FanInfo, find_fan
from power.hw.gpu import GpuInfo, find_gpu
from power.hw.identity import COMPATIBLE, MODEL, NV_TEGRA_RELEASE, BoardIdentity, read_identity
from power.hw.nvpmodel import CONF as NVPMODEL_CONF
from power.hw.rails import INA3221_DRIVER, RailInfo, find_rails
from power.hw.thermal import THERMAL_CLASS, ZoneInfo, find_zones


@dataclass(frozen=True)
class BoardInfo:
    root: str
    identity: BoardIdentity
    gpu: GpuInfo
    emc: EmcInfo
    cpu: CpuInfo
    zones: tuple[ZoneInfo, ...]
    rails: tuple[RailInfo, ...]
    fan: FanInfo
    nvpmodel_conf: str | None
    unavailable: tuple[str, ...]  # "GPU load: none of ... exists"

    @property
    def complete(self) -> bool:
        return not self.unavailable


def discover(root: str | os.PathLike[str] = "/") -> BoardInfo:
    root_s = os.path.normpath(os.path.abspath(os.fspath(root)))
    ident = read_identity(root_s)
    gpu, emc, cpu = find_gpu(root_s), find_emc(root_s), find_cpus(root_s)
    zones, rails, fan = find_zones(root_s), find_rails(root_s), find_fan(root_s)
    conf = NVPMODEL_CONF if sysfs.is_file(root_s, NVPMODEL_CONF) else None
    missing: list[str] = []

    def need(ok: object, what: str) -> None:
        if not ok:
            missing.append(what)

    need(ident.model, f"board model: {MODEL} missing")
    need(ident.compatible, f"board SKU: {COMPATIBLE} missing")
    need(ident.l4t, f"L4T release: {NV_TEGRA_RELEASE} missing or unreadable")
    need(gpu.devfreq, "GPU clock: no devfreq node with a ga10b of_node, nor a known r35/r36 path "
                      "(the node may appear only after the GPU has powered up once)")
    need(gpu.load, "GPU load: no gpu.0/load file")
    need(gpu.railgate, "GPU rail-gating: no railgate_enable file")
    need(emc.rate and emc.locked, f"EMC clock: {BPMP_EMC}/{{rate,mrq_rate_locked}} missing (debugfs mounted? root?)")
    need(emc.cap, "EMC cap: no nvpmodel EMC cap file")
    need(emc.activity, "EMC activity: no mc_all file")
    need(cpu.clusters, "CPU clocks: no cpufreq files")
    need(zones, f"thermal: no zones under {THERMAL_CLASS}")
    need(rails, f"power rails: no labelled INA3221 channels under {INA3221_DRIVER}")
    need(fan.pwm, f"fan: nothing matches {PWM_GLOB}")
    need(conf, f"power modes: {NVPMODEL_CONF} missing")
    return BoardInfo(root_s, ident, gpu, emc, cpu, zones, rails, fan, conf, tuple(missing))
