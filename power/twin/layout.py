"""Lay out a Jetson Orin's sysfs / procfs / etc tree under a folder: the twin's "board on disk".

Owned by the twin. Paths, names, units and formats follow ../shared/ORIN.md (the ground truth) and
the upstream / L4T sources it cites; ``TwinPaths`` names every file the twin's model reads or writes,
for one L4T layout. Where the kernel has a symlink (``/sys/class/devfreq/<node>``, ``cpuN/cpufreq``,
``/sys/class/thermal``, ``/sys/class/hwmon``, ``/sys/bus/i2c/drivers/ina3221/<addr>``, ``devfreq/<node>
/device``, ``<device>/of_node``, ``/proc/device-tree``) the twin makes a *relative* symlink, so a
tree can be moved or copied (``cp -a``) and discovery code follows links the way it must on a board.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from power.physics.boards import BoardSpec, board_for
from power.twin.nvpmodel_conf import (ENGINE_CAPS, GPU0_KNEXT, GPU0_R35, engine_cap_paths,
                                      render_nvpmodel_conf)

TWIN_DIR = "run/orin-agent-twin"            # the twin's own files: twin.json, workload.json
WORKLOAD_FILE = f"{TWIN_DIR}/workload.json"
META_FILE = f"{TWIN_DIR}/twin.json"

# /etc/nv_tegra_release: first line as L4T writes it (R35.4.1 is JetPack 5.1.2, R36.4.3 is
# JetPack 6.2; GCIDs and dates as seen on captured boards).
_TEGRA_RELEASE = {
    "r35": "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
           "DATE: Tue Aug  1 19:57:35 UTC 2023\n",
    "r36": "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
           "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n",
}
_TEGRA_RELEASE_TAIL = ("TARGET_USERSPACE_LIB_DIR=nvidia\n"
                       "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n")

# Thermal zones in the order L4T numbers them; r35 names them "CPU-therm", r36 "cpu-thermal".
ZONE_KINDS = ("cpu", "gpu", "cv0", "cv1", "cv2", "soc0", "soc1", "soc2", "tj")
# Every AGX Orin zone: software throttle 99.0 °C (passive), shutdown 104.5 °C (critical): upstream
# "arm64: tegra: Add thermal support for Tegra234" (ORIN.md). NX/Nano: the same two are assumed
# (same T234 thermal config; unconfirmed), plus the fan trips on tj of the upstream p3767 patch.
_TRIPS = ((104500, "critical", 0), (99000, "passive", 0))
_P3767_TJ_TRIPS = ((74000, "active", 4000), (95000, "active", 4000))
GPU_GOVERNORS = "nvhost_podgov userspace performance simple_ondemand"
CPU_GOVERNORS = "interactive conservative ondemand userspace powersave performance schedutil"


@dataclass(frozen=True)
class TwinPaths:
    """Every file of one board x L4T layout the model touches, relative to the root."""
    devfreq_node: str                   # "17000000.ga10b" (r35) / "17000000.gpu" (r36)
    gpu_device: str                     # the devfreq node's `device`
    gpu_devfreq: str                    # <gpu_device>/devfreq/<node>
    gpu0: str                           # nvgpu's own dir: load, railgate_enable, tpc_pg_mask
    gpu_loads: tuple[str, ...]
    emc: str                            # bpmp debugfs clk dir
    emc_caps: tuple[str, ...]
    actmon: str
    cpu: str
    thermal_zone_types: tuple[str, ...]
    ina: tuple[tuple[str, str], ...]    # (i2c address, hwmon dir)
    fan_hwmon: str
    nvpmodel_conf: str = "etc/nvpmodel.conf"
    nvpmodel_status: str = "var/lib/nvpmodel/status"

    def zone(self, i: int) -> str:
        return f"sys/devices/virtual/thermal/thermal_zone{i}"

    def policy(self, first_cpu: int) -> str:
        return f"{self.cpu}/cpufreq/policy{first_cpu}"


def twin_paths(spec: BoardSpec, l4t: str) -> TwinPaths:
    if l4t == "r35":
        node, dev, gpu0, plat = "17000000.ga10b", "sys/devices/17000000.ga10b", GPU0_R35, "sys/devices/platform"
        loads: tuple[str, ...] = (f"{gpu0[1:]}/load",)
        caps: tuple[str, ...] = ("sys/kernel/nvpmodel_emc_cap/emc_iso_cap",)
        actmon = "sys/kernel/actmon_avg_activity/mc_all"
        zones = tuple({"cpu": "CPU", "gpu": "GPU", "tj": "tj"}.get(k, k.upper()) + "-therm"
                      for k in ZONE_KINDS)
    else:
        node, dev, gpu0, plat = ("17000000.gpu", "sys/devices/platform/bus@0/17000000.gpu", GPU0_KNEXT,
                                 "sys/devices/platform/bus@0")
        loads = (f"{gpu0[1:]}/load", f"{dev}/load")
        caps = ("sys/kernel/nvpmodel_emc_cap/emc_iso_cap", "sys/kernel/nvpmodel_clk_cap/emc")
        actmon = "sys/kernel/debug/cactmon/mc_all"
        zones = tuple(f"{k}-thermal" for k in ZONE_KINDS)
    i2c = f"{plat}/c240000.i2c/i2c-1"
    addrs = sorted({r.address for r in spec.rails})
    return TwinPaths(
        devfreq_node=node, gpu_device=dev, gpu_devfreq=f"{dev}/devfreq/{node}", gpu0=gpu0[1:],
        gpu_loads=loads, emc="sys/kernel/debug/bpmp/debug/clk/emc", emc_caps=caps, actmon=actmon,
        cpu="sys/devices/system/cpu", thermal_zone_types=zones,
        ina=tuple((a, f"{i2c}/{a}/hwmon/hwmon{3 + i}") for i, a in enumerate(addrs)),
        fan_hwmon="sys/devices/platform/pwm-fan/hwmon/hwmon2")


class _Tree:
    """Writes files and relative symlinks under a root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, rel: str, content: str | bytes) -> None:
        p = self.root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content if content.endswith("\n") or not content else content + "\n")

    def link(self, rel: str, target_rel: str) -> None:
        """A relative symlink at ``rel`` pointing at ``target_rel`` (both relative to the root)."""
        p = self.root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        (self.root / target_rel.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists():
            return
        os.symlink(os.path.relpath(self.root / target_rel.lstrip("/"), p.parent), p)


def _identity(t: _Tree, spec: BoardSpec, l4t: str) -> None:
    dt = "sys/firmware/devicetree/base"
    t.write(f"{dt}/model", spec.model.encode() + b"\0")            # NUL-terminated like the DT
    t.write(f"{dt}/compatible", b"".join(c.encode() + b"\0" for c in spec.compatible))
    t.link("proc/device-tree", dt)
    t.write("etc/nv_tegra_release", _TEGRA_RELEASE[l4t] + _TEGRA_RELEASE_TAIL)


def _gpu(t: _Tree, spec: BoardSpec, paths: TwinPaths, l4t: str) -> None:
    mode = spec.mode(spec.default_mode)
    dt_bus = "sys/firmware/devicetree/base" + ("/bus@0" if l4t == "r36" else "")
    t.write(f"{dt_bus}/gpu@17000000/compatible", b"nvidia,ga10b\0")
    t.write(f"{dt_bus}/gpu@17000000/name", b"gpu\0")
    t.link(f"{paths.gpu_device}/of_node", f"{dt_bus}/gpu@17000000")
    d = paths.gpu_devfreq
    t.write(f"{d}/available_frequencies", " ".join(map(str, spec.gpu_hz)))
    t.write(f"{d}/min_freq", str(spec.gpu_hz[0]))
    cap = mode.gpu_max_hz or spec.gpu_max_hz
    t.write(f"{d}/max_freq", str(max(f for f in spec.gpu_hz if f <= cap)))
    t.write(f"{d}/cur_freq", str(spec.gpu_hz[0]))
    t.write(f"{d}/target_freq", str(spec.gpu_hz[0]))
    t.write(f"{d}/governor", "nvhost_podgov")
    t.write(f"{d}/available_governors", GPU_GOVERNORS)
    t.write(f"{d}/polling_interval", "0")       # podgov samples on its own timer, not devfreq's
    t.link(f"{d}/device", paths.gpu_device)
    t.link(f"sys/class/devfreq/{paths.devfreq_node}", d)
    if l4t == "r36":    # NVIDIA's r36 nvpmodel paths: /sys/devices/platform/17000000.gpu/devfreq_dev
        t.link("sys/devices/platform/17000000.gpu", paths.gpu_device)
        t.link(f"{paths.gpu_device}/devfreq_dev", d)
    # A second, non-GPU devfreq node, so discovery must really check of_node (VIC on every T234).
    vic_dev = ("sys/devices/platform/bus@0/13e00000.host1x/15340000.vic" if l4t == "r36"
               else "sys/devices/platform/13e40000.host1x/15340000.vic")
    t.write(f"{dt_bus}/host1x@13e00000/vic@15340000/compatible", b"nvidia,tegra234-vic\0")
    t.write(f"{dt_bus}/host1x@13e00000/vic@15340000/name", b"vic\0")
    t.link(f"{vic_dev}/of_node", f"{dt_bus}/host1x@13e00000/vic@15340000")
    vd = f"{vic_dev}/devfreq/15340000.vic"
    for f, v in (("available_frequencies", "115200000 345600000 729600000"),
                 ("min_freq", "115200000"), ("max_freq", "729600000"), ("cur_freq", "115200000"),
                 ("governor", "nvhost_podgov"), ("available_governors", GPU_GOVERNORS)):
        t.write(f"{vd}/{f}", v)
    t.link(f"{vd}/device", vic_dev)
    t.link("sys/class/devfreq/15340000.vic", vd)
    g = paths.gpu0
    for load in paths.gpu_loads:
        t.write(load, "0")                      # per-mille 0..1000
    t.write(f"{g}/railgate_enable", "1")
    t.write(f"{g}/tpc_pg_mask", str(mode.tpc_pg_mask))
    t.write(f"{g}/power/control", "auto")
    if spec.module.startswith("p3767"):
        t.write(f"{g}/fbp_pg_mask", "2")


def _emc(t: _Tree, spec: BoardSpec, paths: TwinPaths) -> None:
    mode = spec.mode(spec.default_mode)
    # bpmp debugfs: rates in Hz; unlocked, the bandwidth manager moves `rate` (captured idle AGX
    # boards show EMC at 2133 MHz).
    idle = max(f for f in spec.emc_hz if f <= 2133000000)
    for f, v in (("rate", idle), ("min_rate", spec.emc_hz[0]), ("max_rate", spec.emc_max_hz),
                 ("mrq_rate_locked", 0)):
        t.write(f"{paths.emc}/{f}", str(v))
    for cap in paths.emc_caps:
        t.write(cap, str(mode.emc_cap_hz or 0))   # 0 = no cap, as nvpmodel writes it
    t.write(paths.actmon, "0")


def _cpus(t: _Tree, spec: BoardSpec, paths: TwinPaths) -> None:
    mode = spec.mode(spec.default_mode)
    n = spec.cpu_count
    c = paths.cpu
    on = mode.online_cores
    t.write(f"{c}/present", f"0-{n - 1}")
    t.write(f"{c}/possible", f"0-{n - 1}")
    t.write(f"{c}/online", f"0-{on - 1}")
    t.write(f"{c}/offline", f"{on}-{n - 1}" if on < n else "")
    cap = mode.cpu_max_khz or spec.cpu_khz[-1]
    for cluster in spec.cpu_clusters:
        p = paths.policy(cluster[0])
        cpus = " ".join(map(str, cluster))
        for f, v in (("affected_cpus", cpus), ("related_cpus", cpus),
                     ("cpuinfo_min_freq", spec.cpu_khz[0]), ("cpuinfo_max_freq", spec.cpu_khz[-1]),
                     ("cpuinfo_transition_latency", 500000),
                     ("scaling_available_frequencies", " ".join(map(str, spec.cpu_khz))),
                     ("scaling_available_governors", CPU_GOVERNORS), ("scaling_driver", "tegra194"),
                     ("scaling_governor", "schedutil"), ("scaling_min_freq", 729600),
                     ("scaling_max_freq", max(f for f in spec.cpu_khz if f <= cap)),
                     ("scaling_cur_freq", 729600), ("cpuinfo_cur_freq", 729600)):
            t.write(f"{p}/{f}", str(v))
        for cpu in cluster:
            t.write(f"{c}/cpu{cpu}/online", "1" if cpu < on else "0")
            t.link(f"{c}/cpu{cpu}/cpufreq", p)
            for state, name in (("state0", "WFI"), ("state1", "c7")):   # `jetson_clocks --show`: IdleStates
                t.write(f"{c}/cpu{cpu}/cpuidle/{state}/name", name)
                t.write(f"{c}/cpu{cpu}/cpuidle/{state}/disable", "0")


def _thermal(t: _Tree, spec: BoardSpec, paths: TwinPaths, ambient_c: float) -> None:
    for i, name in enumerate(paths.thermal_zone_types):
        z = paths.zone(i)
        t.write(f"{z}/type", name)
        t.write(f"{z}/temp", str(round(ambient_c * 1000)))      # m°C
        t.write(f"{z}/mode", "enabled")
        t.write(f"{z}/policy", "step_wise")
        trips = _TRIPS + (_P3767_TJ_TRIPS if spec.module.startswith("p3767")
                          and ZONE_KINDS[i] == "tj" else ())
        for n, (temp, kind, hyst) in enumerate(trips):
            t.write(f"{z}/trip_point_{n}_temp", str(temp))
            t.write(f"{z}/trip_point_{n}_type", kind)
            t.write(f"{z}/trip_point_{n}_hyst", str(hyst))
        t.link(f"sys/class/thermal/thermal_zone{i}", z)


def _rails(t: _Tree, spec: BoardSpec, paths: TwinPaths) -> None:
    for addr, hw in paths.ina:
        t.write(f"{hw}/name", "ina3221")
        for r in (r for r in spec.rails if r.address == addr):
            n = r.channel
            t.write(f"{hw}/in{n}_label", r.label)
            t.write(f"{hw}/in{n}_input", str(r.bus_mv))     # mV
            t.write(f"{hw}/in{n}_enable", "0" if r.label == "NC" else "1")
            t.write(f"{hw}/in{n + 3}_input", "0")           # shunt voltage, mV
            t.write(f"{hw}/curr{n}_input", "0")             # mA
            t.write(f"{hw}/curr{n}_crit", str(r.crit_ma))
            t.write(f"{hw}/curr{n}_max", str(r.crit_ma * 4 // 5))
            t.write(f"{hw}/shunt{n}_resistor", str(r.shunt_uohm))   # µOhm
        # channel 7 / curr4: the summation channel (skipped by readers: ORIN.md)
        t.write(f"{hw}/in7_label", "sum of shunt voltages")
        t.write(f"{hw}/in7_input", "0")
        t.write(f"{hw}/curr4_input", "0")
        t.write(f"{hw}/curr4_crit", "0")
        dev = hw.rsplit("/hwmon/", 1)[0]
        t.link(f"sys/bus/i2c/drivers/ina3221/{addr}", dev)
        t.link(f"sys/class/hwmon/{hw.rsplit('/', 1)[1]}", hw)


def _fan(t: _Tree, paths: TwinPaths) -> None:
    t.write(f"{paths.fan_hwmon}/name", "pwmfan")
    t.write(f"{paths.fan_hwmon}/pwm1", "0")       # 0-255; nvfancontrol owns it unless stopped
    t.link(f"sys/class/hwmon/{paths.fan_hwmon.rsplit('/', 1)[1]}", paths.fan_hwmon)


# How /etc/nvpmodel.conf appears: a plain file; absent (inside most containers); or, as on a flashed
# board, an absolute symlink into /etc/nvpmodel/ (ORIN.md field notes), which only resolves inside
# the root when the reader resolves it there.
CONF_STYLES = ("file", "absent", "symlink")


def _nvpmodel(t: _Tree, spec: BoardSpec, paths: TwinPaths, conf_style: str = "file") -> None:
    mode = spec.mode(spec.default_mode)
    if conf_style == "file":
        t.write(paths.nvpmodel_conf, render_nvpmodel_conf(spec))
    elif conf_style == "symlink":
        target = f"/etc/nvpmodel/{spec.conf_name}"
        t.write(target, render_nvpmodel_conf(spec))
        os.symlink(target, t.root / paths.nvpmodel_conf)
    # nvpmodel records the mode it applied; the fan mode is nvfancontrol's ("cool" by default).
    t.write(paths.nvpmodel_status, f"pmode:{mode.id:04d} fmode:cool")
    if spec.has_dla:        # the DLA/PVA cap files nvpmodel.conf names, at both layouts' paths
        caps = (mode.dla_core_hz, mode.dla_falcon_hz, mode.dla_core_hz, mode.dla_falcon_hz,
                mode.pva_vps_hz, mode.pva_axi_hz)
        for (_, dev, name), v in zip(ENGINE_CAPS, caps):
            for p in engine_cap_paths(dev, name):
                t.write(p, str(v if v is not None else 1600000000))


def create_twin(root: Path | str, board: str, l4t: str, ambient_c: float = 25.0, *, debugfs: bool = True,
                nvpmodel_conf: str = "file") -> TwinPaths:
    """Lay out ``board`` under ``l4t`` (r35 / r36) at ``root``; returns the layout's paths.

    The tree starts at the board's default nvpmodel mode, idle, at ambient temperature. Raises
    ``KeyError`` naming the valid boards / releases for an unknown name. The situations of
    containers and flashed boards: ``debugfs=False`` leaves ``/sys/kernel/debug`` out (no bpmp EMC
    files, no cactmon); ``nvpmodel_conf`` is one of ``CONF_STYLES``.
    """
    if nvpmodel_conf not in CONF_STYLES:
        raise ValueError(f"nvpmodel_conf {nvpmodel_conf!r}; valid: {', '.join(CONF_STYLES)}")
    spec = board_for(board, l4t)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = twin_paths(spec, l4t)
    t = _Tree(root)
    _identity(t, spec, l4t)
    _gpu(t, spec, paths, l4t)
    _emc(t, spec, paths)
    _cpus(t, spec, paths)
    _thermal(t, spec, paths, ambient_c)
    _rails(t, spec, paths)
    _fan(t, paths)
    _nvpmodel(t, spec, paths, nvpmodel_conf)
    if not debugfs:
        shutil.rmtree(root / "sys/kernel/debug")
    t.write(META_FILE, json.dumps({"board": board, "l4t": l4t, "format": 1}))
    t.write(WORKLOAD_FILE, json.dumps({"phase": "idle", "gpu_util": 0.0, "mem_util": 0.0}))
    return paths


DEFAULT_BOARD = "agx-orin-64gb"     # the twin a front end runs on when there is no board (and no --root)
DEFAULT_L4T = "r36"


def make_temp_twin(board: str = DEFAULT_BOARD, l4t: str = DEFAULT_L4T) -> Path:
    """A fresh twin tree in a new temporary folder (the caller removes it when done)."""
    root = Path(tempfile.mkdtemp(prefix="orin-agent-twin-"))
    create_twin(root, board, l4t)
    return root


def read_meta(root: Path | str) -> tuple[str, str]:
    """(board, l4t) of a tree made by ``create_twin``; ``FileNotFoundError`` if it is not one."""
    meta = json.loads((Path(root) / META_FILE).read_text())
    return str(meta["board"]), str(meta["l4t"])
