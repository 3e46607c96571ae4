"""Discovery on hand-made trees in tmp_path: both layouts, fallbacks, missing files, offline zones."""
from __future__ import annotations

import os
import shutil

import pytest

from power.hw import sysfs
from power.hw.backends import SysfsBoard, open_board
from power.hw.discovery import discover
from power.runtime.status import read_status
from power_tree import make_tree, put


@pytest.mark.parametrize("layout", ["r35", "r36"])
def test_full_tree_is_discovered(tmp_path, layout):
    info = discover(make_tree(tmp_path, layout))
    assert info.unavailable == ()
    assert info.identity.board == "agx-orin-64gb" and info.identity.l4t.layout == layout
    node = "17000000.ga10b" if layout == "r35" else "17000000.gpu"
    assert info.gpu.devfreq.endswith(f"devfreq/{node}") and info.gpu.found_by.startswith("devfreq class")
    assert info.gpu.available_hz[-1] == 1300500000
    assert [c.name for c in info.cpu.clusters] == ["cpu0-3", "cpu4-7", "cpu8-11"]
    assert [z.name for z in info.zones] == ["cpu", "gpu", "cv0", "soc0", "tj"]
    # NC and the sum-of-shunts channel are skipped; 1-0041's second channel is a real rail.
    assert [r.label for r in info.rails] == ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"]
    assert info.fan.pwm == "/sys/devices/platform/pwm-fan/hwmon/hwmon2/pwm1"


def test_absolute_links_stay_inside_the_root(tmp_path):
    root = make_tree(tmp_path, "r36")
    # /sys/class/devfreq/17000000.gpu -> /sys/devices/... (absolute): must resolve under root
    host = sysfs.resolve(root, "/sys/class/devfreq/17000000.gpu/max_freq")
    assert host.startswith(str(root)) and os.path.isfile(host)
    assert sysfs.resolve(root, "/../../../etc/passwd") == os.path.join(str(root), "etc/passwd")


def test_status_reads_the_values_in_the_tree(tmp_path):
    st = read_status(SysfsBoard(make_tree(tmp_path, "r35")))
    clocks = {c.name: c for c in st.clocks}
    assert (clocks["gpu"].cur, clocks["gpu"].min, clocks["gpu"].max) == (306000000, 306000000, 1300500000)
    assert clocks["gpu"].detail["load_pct"] == 25.0
    assert clocks["emc"].cur == 2133000000 and clocks["emc"].detail["cap"] is None  # 0 = no cap
    assert clocks["emc"].detail["util_pct"] == pytest.approx(10.0)  # mc_all / (rate/1000)
    assert (clocks["cpu4-7"].unit, clocks["cpu4-7"].cur, clocks["cpu4-7"].max) == ("kHz", 1113600, 2201600)
    assert st.power_mode.name == "MODE_30W" and st.power_mode.id == 2
    zones = {z.name: z for z in st.zones}
    assert zones["tj"].temp_c == 44.0 and zones["cpu"].type == "CPU-therm"
    assert [(t.type, t.temp_c) for t in zones["gpu"].trips] == [("critical", 104.5), ("passive", 99.0)]
    rails = {r.label: r for r in st.rails}
    assert rails["VDD_CPU_CV"].mw == 1000.0  # 5000 mV x 200 mA
    assert st.total_mw == pytest.approx(500 + 1000 + 1500 + 300)  # AGX: no VDD_IN, sum of rails
    assert st.fan_pwm == 77 and st.l4t == "35.4.1"


def test_nx_total_is_vdd_in(tmp_path):
    st = read_status(SysfsBoard(make_tree(tmp_path, "r36", nx=True)))
    assert st.total_mw == 500.0


def test_fallback_paths_when_class_link_is_missing(tmp_path):
    root = make_tree(tmp_path, "r36")
    (root / "sys/class/devfreq/17000000.gpu").unlink()
    info = discover(root)
    assert info.gpu.devfreq == "/sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu"
    assert info.gpu.found_by == "known path"


def test_cpu_clusters_without_related_cpus(tmp_path):
    root = make_tree(tmp_path, "r36", cpus=6)
    for c in range(6):
        (root / f"sys/devices/system/cpu/cpu{c}/cpufreq/related_cpus").unlink()
    assert [c.name for c in discover(root).cpu.clusters] == ["cpu0-3", "cpu4-5"]


def test_missing_files_are_reported_not_raised(tmp_path):
    root = make_tree(tmp_path, "r36")
    shutil.rmtree(root / "sys/kernel/debug")
    shutil.rmtree(root / "sys/devices/platform/pwm-fan")
    (root / "etc/nvpmodel.conf").unlink()
    info = discover(root)
    text = "\n".join(info.unavailable)
    assert "EMC clock" in text and "fan" in text and "power modes" in text
    st = read_status(SysfsBoard(root))
    assert "emc" not in {c.name for c in st.clocks} and st.fan_pwm is None
    assert st.power_mode.source == "status file" and st.power_mode.name is None


def test_empty_root_is_all_unavailable(tmp_path):
    info = discover(tmp_path)
    assert len(info.unavailable) >= 10
    st = read_status(SysfsBoard(tmp_path))
    assert st.clocks == () and st.zones == () and st.total_mw is None and st.power_mode is None


def test_unreadable_zone_is_offline_never_zero(tmp_path):
    root = make_tree(tmp_path, "r35")
    zone = root / "sys/devices/virtual/thermal/thermal_zone2/temp"
    zone.unlink()
    zone.mkdir()  # reading a directory fails like an unreadable sysfs attribute
    put(root, "/sys/devices/virtual/thermal/thermal_zone3/temp", "-256000\n")
    put(root, "/sys/devices/virtual/thermal/thermal_zone4/temp", "garbage\n")
    zones = {z.name: z for z in read_status(SysfsBoard(root)).zones}
    assert zones["cv0"].temp_c is None and not zones["cv0"].online
    assert zones["soc0"].temp_c is None and zones["tj"].temp_c is None
    assert zones["cpu"].temp_c == 40.0


def test_factory_picks_sysfs_off_the_host(tmp_path):
    root = make_tree(tmp_path, "r36")
    assert open_board(root).backend == "sysfs"
    with pytest.raises(OSError, match="jtop backend needs root"):
        open_board(root, backend="jtop")
    with pytest.raises(ValueError, match="unknown backend"):
        open_board(root, backend="nvml")


def _resolve_by_joins(root, path):
    """The plain form of sysfs.resolve (one os.path.join of every component so far per step), which the fast
    form must equal on any path."""
    root_s = os.path.normpath(os.path.abspath(os.fspath(root)))
    parts = [p for p in path.split("/") if p and p != "."]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root_s, *resolved, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                return candidate
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        resolved.append(part)
    return os.path.join(root_s, *resolved)


def test_resolve_equals_the_plain_component_walk(tmp_path):
    import random

    root = make_tree(tmp_path / "t", "r36")
    os.symlink("../gpu-loop", root / "sys" / "gpu-loop")  # a link to itself: the hop limit ends it
    os.symlink("devfreq/../devfreq", root / "sys" / "class" / "rel")  # relative, with ".."
    words = ["sys", "class", "devfreq", "17000000.gpu", "devices", "platform", "..", ".", "", "cur_freq",
             "gpu-loop", "rel", "etc", "nvpmodel.conf", "thermal", "thermal_zone0", "hwmon", "missing"]
    rng = random.Random(7)
    paths = ["/sys/class/devfreq/17000000.gpu/cur_freq", "/etc/nvpmodel.conf", "/sys/gpu-loop/x", "/", "",
             "/../..", "/sys/class/rel/17000000.gpu/max_freq"]
    paths += ["/" + "/".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    for p in paths:
        assert sysfs.resolve(root, p) == _resolve_by_joins(root, p), p
    assert sysfs.resolve("/", "/proc/../proc/self") == _resolve_by_joins("/", "/proc/../proc/self")
