"""Hand-made Orin file trees for the board-layer tests (independent of power.twin).

A small AGX-Orin-like tree in r35 or r36 layout, with the kernel's links made as *absolute*
symlinks (as a copied board would have them), so discovery must re-root them to stay in the tree.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
GPU_HZ = (306000000, 408000000, 612000000, 816000000, 1300500000)
CPU_KHZ = (729600, 1113600, 1497600, 1728000, 2201600)


def put(root: Path, path: str, content: str | bytes) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)


def link(root: Path, path: str, target: str) -> None:
    """An absolute link (``/sys/...``) as on a board: only a rooted resolver keeps it in the tree."""
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    (root / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    os.symlink(target, p)


def make_tree(root: Path, layout: str = "r36", *, cpus: int = 12, nx: bool = False) -> Path:
    put(root, "/proc/device-tree/model", "NVIDIA Jetson AGX Orin Developer Kit\0")
    put(root, "/proc/device-tree/compatible", b"nvidia,p3737-0000+p3701-0005\0nvidia,p3701-0005\0nvidia,tegra234\0")
    put(root, "/etc/nv_tegra_release", (DATA / "identity" / f"nv_tegra_release_{layout}").read_text())
    if layout == "r35":
        dev, node, gpu0 = "/sys/devices/17000000.ga10b", "17000000.ga10b", "/sys/devices/gpu.0"
        zone_names = ["CPU-therm", "GPU-therm", "CV0-therm", "SOC0-therm", "tj-therm"]
    else:
        dev, node, gpu0 = "/sys/devices/platform/bus@0/17000000.gpu", "17000000.gpu", "/sys/devices/platform/gpu.0"
        zone_names = ["cpu-thermal", "gpu-thermal", "cv0-thermal", "soc0-thermal", "tj-thermal"]
    df = f"{dev}/devfreq/{node}"
    put(root, f"{df}/available_frequencies", " ".join(map(str, GPU_HZ)) + "\n")
    for name, v in (("min_freq", GPU_HZ[0]), ("max_freq", GPU_HZ[-1]), ("cur_freq", GPU_HZ[0])):
        put(root, f"{df}/{name}", f"{v}\n")
    put(root, f"{df}/governor", "nvhost_podgov\n")
    put(root, f"/sys/firmware/devicetree/base/{node}/compatible", b"nvidia,ga10b\0")
    put(root, f"/sys/firmware/devicetree/base/{node}/name", b"gpu\0")
    link(root, f"{dev}/of_node", f"/sys/firmware/devicetree/base/{node}")
    link(root, f"{df}/device", dev)
    link(root, f"/sys/class/devfreq/{node}", df)
    put(root, f"{gpu0}/load", "250\n")
    put(root, f"{gpu0}/railgate_enable", "1\n")
    emc = "/sys/kernel/debug/bpmp/debug/clk/emc"
    for name, v in (("rate", 2133000000), ("min_rate", 204000000), ("max_rate", 3199000000), ("mrq_rate_locked", 0)):
        put(root, f"{emc}/{name}", f"{v}\n")
    put(root, "/sys/kernel/nvpmodel_emc_cap/emc_iso_cap", "0\n")
    put(root, "/sys/kernel/actmon_avg_activity/mc_all", "213300\n")
    for c in range(cpus):
        base = f"/sys/devices/system/cpu/cpu{c}"
        if c:
            put(root, f"{base}/online", "1\n")
        first = c - c % 4
        put(root, f"{base}/cpufreq/related_cpus", " ".join(str(x) for x in range(first, min(first + 4, cpus))) + "\n")
        put(root, f"{base}/cpufreq/scaling_available_frequencies", " ".join(map(str, CPU_KHZ)) + " \n")
        for name, v in (("scaling_min_freq", CPU_KHZ[0]), ("scaling_max_freq", CPU_KHZ[-1]),
                        ("scaling_cur_freq", CPU_KHZ[1])):
            put(root, f"{base}/cpufreq/{name}", f"{v}\n")
        put(root, f"{base}/cpufreq/scaling_governor", "schedutil\n")
    for i, zname in enumerate(zone_names):
        z = f"/sys/devices/virtual/thermal/thermal_zone{i}"
        put(root, f"{z}/type", zname + "\n")
        put(root, f"{z}/temp", f"{40000 + 1000 * i}\n")
        put(root, f"{z}/trip_point_0_temp", "104500\n")
        put(root, f"{z}/trip_point_0_type", "critical\n")
        put(root, f"{z}/trip_point_1_temp", "99000\n")
        put(root, f"{z}/trip_point_1_type", "passive\n")
        put(root, f"{z}/trip_point_1_hyst", "0\n")
        link(root, f"/sys/class/thermal/thermal_zone{i}", z)
    labels = (("VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC") if nx else ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"))
    i2c = "/sys/devices/platform/c240000.i2c/i2c-1"
    hw = f"{i2c}/1-0040/hwmon/hwmon3"
    for ch, lab in enumerate(labels, 1):
        put(root, f"{hw}/in{ch}_label", lab + "\n")
        put(root, f"{hw}/in{ch}_input", "5000\n")
        put(root, f"{hw}/curr{ch}_input", f"{100 * ch}\n")
        put(root, f"{hw}/curr{ch}_crit", "4000\n")
    put(root, f"{hw}/in7_label", "sum of shunt voltages\n")  # upstream driver's sum channel: skipped
    put(root, f"{hw}/in7_input", "12\n")
    link(root, "/sys/bus/i2c/drivers/ina3221/1-0040", f"{i2c}/1-0040")
    if not nx:
        hw2 = f"{i2c}/1-0041/hwmon/hwmon4"
        put(root, f"{hw2}/in1_label", "NC\n")
        put(root, f"{hw2}/in1_input", "0\n")
        put(root, f"{hw2}/in2_label", "VDDQ_VDD2_1V8AO\n")
        put(root, f"{hw2}/in2_input", "5000\n")
        put(root, f"{hw2}/curr2_input", "60\n")
        link(root, "/sys/bus/i2c/drivers/ina3221/1-0041", f"{i2c}/1-0041")
    put(root, "/sys/devices/platform/pwm-fan/hwmon/hwmon2/pwm1", "77\n")
    put(root, "/etc/nvpmodel.conf", (DATA / "nvpmodel" / "nvpmodel_p3701_0000_2023.conf").read_text())
    put(root, "/var/lib/nvpmodel/status", "pmode:0002 fmode:cool\n")
    return root


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every regular file's bytes (links are not followed), for byte-identical comparisons; the board
    lock (run/lock/orin-agent/, power.hw.rootlock) is left out: it stays after every run, as on a board."""
    out: dict[str, bytes | None] = {}
    for dp, dns, fns in os.walk(root):
        for n in fns + dns:
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, root)
            if rel.startswith("run/lock/orin-agent/"):
                continue
            if os.path.islink(p):
                out[rel] = ("->" + os.readlink(p)).encode()
            elif os.path.isfile(p):
                with open(p, "rb") as fh:
                    out[rel] = fh.read()
    return out
