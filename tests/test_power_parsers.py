"""Parsers of NVIDIA's formats, on captured real text (tests/data/SOURCES.md says where from)."""
from __future__ import annotations

from pathlib import Path

import pytest

from power.hw.identity import module_from_compatible
from power.hw.parsers import (NvpModelConfError, format_store_file, parse_compatible, parse_jetson_clocks_show,
                           parse_nv_tegra_release, parse_nvpmodel_conf, parse_nvpmodel_query,
                           parse_nvpmodel_status, parse_store_file)
from power.hw.tegrastats import parse_tegrastats

DATA = Path(__file__).parent / "data"


def text(rel: str) -> str:
    return (DATA / rel).read_text()


def test_agx_orin_nvpmodel_conf_modes_match_orin_md():
    conf = parse_nvpmodel_conf(text("nvpmodel/nvpmodel_p3701_0000_2023.conf"))
    assert [(m.id, m.name) for m in conf.modes] == [(0, "MAXN"), (1, "MODE_15W"), (2, "MODE_30W"), (3, "MODE_50W")]
    assert conf.default_id == 2  # ORIN.md: 30W is the boot default
    maxn, m15, m30, m50 = conf.modes
    assert maxn.max_cap("GPU") is None and maxn.max_cap("EMC") is None and maxn.max_cap("CPU_A78_0") is None
    assert m15.max_cap("CPU_A78_0") == 1113600 and m15.max_cap("EMC") == 2133000000
    assert m30.max_cap("CPU_A78_1") == 1728000 and m50.max_cap("CPU_A78_2") == 1497600
    assert m15.value("TPC_POWER_GATING", "TPC_PG_MASK") == "248"
    assert len(m15.online_cores()) == 4 and len(m30.online_cores()) == 8 and len(m50.online_cores()) == 12
    assert m15.min_floor("GPU") is None  # MIN_FREQ 0 = the hardware minimum
    gpu = conf.params["GPU"]
    assert gpu.type == "CLOCK"
    assert gpu.paths("MAX_FREQ") == ("/sys/devices/17000000.ga10b/devfreq/17000000.ga10b/max_freq",
                                     "/sys/devices/platform/17000000.gpu/devfreq_dev/max_freq")
    assert conf.params["EMC"].paths("MAX_FREQ")[1] == "/sys/kernel/nvpmodel_clk_cap/emc"


def test_2022_revision_writes_emc_no_cap_as_zero():
    conf = parse_nvpmodel_conf(text("nvpmodel/nvpmodel_p3701_0000.conf"))
    assert conf.mode("MAXN").value("EMC", "MAX_FREQ") == "0"
    assert conf.mode("MAXN").max_cap("EMC") is None


@pytest.mark.parametrize("name,modes,default", [
    ("nvpmodel_p3701_0004.conf", ["MAXN", "MODE_15W", "MODE_30W", "MODE_40W"], 2),
    ("nvpmodel_p3767_0000.conf", ["MAXN", "10W", "15W", "25W"], 2),
    ("nvpmodel_p3767_0003.conf", ["15W", "7W"], 0),
])
def test_other_boards_conf(name, modes, default):
    conf = parse_nvpmodel_conf(text(f"nvpmodel/{name}"))
    assert [m.name for m in conf.modes] == modes
    assert conf.default_id == default
    assert conf.mode(conf.default_id).name == modes[default]


def test_conf_mode_lookup_by_name_and_bad_key():
    conf = parse_nvpmodel_conf(text("nvpmodel/nvpmodel_p3767_0000.conf"))
    assert conf.mode("15w").id == 2 and conf.mode("3").name == "25W"
    with pytest.raises(ValueError, match="this board has: 0 MAXN"):
        conf.mode(9)


@pytest.mark.parametrize("bad,msg", [
    ("< POWER_MODEL ID=0 NAME=X >\nGPU MAX_FREQ 1\n", "PARAM GPU is not defined"),
    ("GPU MAX_FREQ 1\n", "line 1: text outside"),
    ("< PARAM TYPE=CLOCK NAME=GPU >\nMAX_FREQ\n", "line 2"),
    ("# only comments\n", "no POWER_MODEL"),
    ("< PM_CONFIG DEFAULT=x >\n", "PM_CONFIG needs DEFAULT"),
])
def test_conf_errors_name_the_line(bad, msg):
    with pytest.raises(NvpModelConfError, match=msg):
        parse_nvpmodel_conf(bad)


def test_nvpmodel_query_plain_and_verbose():
    q = parse_nvpmodel_query(text("nvpmodel_q/agx_orin_30w.txt"))
    assert (q.name, q.id) == ("MODE_30W", 2)
    q = parse_nvpmodel_query(text("nvpmodel_q/orin_nano_super_maxn.txt"))
    assert (q.name, q.id) == ("MAXN_SUPER", 2)
    q = parse_nvpmodel_query(text("nvpmodel_q/orin_nano_r36_verbose.txt"))
    assert (q.name, q.id) == ("25W", 1)
    with pytest.raises(ValueError):
        parse_nvpmodel_query("nvpmodel: command not found\n")


def test_nvpmodel_status_file():
    assert parse_nvpmodel_status("pmode:0002 fmode:cool\n") == 2
    assert parse_nvpmodel_status("pmode:0000") == 0
    assert parse_nvpmodel_status("garbage") is None


def test_jetson_clocks_show_agx_maxn():
    s = parse_jetson_clocks_show(text("jetson_clocks/agx_orin_maxn_r35.txt"))
    assert s.soc_family == "tegra234" and s.online_cpus == "0-11"
    assert [c.cpu for c in s.cpus] == list(range(12))  # sorted numerically, not cpu0, cpu1, cpu10
    assert s.cpus[10].cur == 1113600 and s.cpus[0].governor == "schedutil"
    assert s.gpu.min == 306000000 and s.gpu.max == 1300500000
    assert s.emc.cur == 2133000000 and s.emc_locked is False
    assert s.engines["DLA0_CORE"].max == 1600000000 and "PVA0_AXI" in s.engines
    assert s.fan_pwm == {"hwmon2_pwm1": 55}
    assert s.power_mode == "MAXN" and s.active_gpu_tpcs is None


def test_jetson_clocks_show_pinned_30w_and_nano():
    s = parse_jetson_clocks_show(text("jetson_clocks/agx_orin_30w_pinned.txt"))
    assert s.gpu.min == s.gpu.max == 612000000 and s.emc_locked is True
    assert [c.online for c in s.cpus].count(False) == 4 and s.active_gpu_tpcs == 4
    assert s.power_mode == "MODE_30W" and s.fan_pwm == {"hwmon0_pwm1": 48}
    n = parse_jetson_clocks_show(text("jetson_clocks/orin_nano_super_r36_25w.txt"))
    assert len(n.cpus) == 6 and n.gpu.max == 918000000 and n.power_mode == "25W"


def test_store_file_roundtrip():
    entries = parse_store_file(text("jetson_clocks/jetson_nano_t210_store.conf"))
    assert entries[0] == ("/sys/devices/system/cpu/cpu0/online", "1")
    assert ("/sys/devices/57000000.gpu/devfreq/57000000.gpu/min_freq", "76800000") in entries
    assert format_store_file(entries) == text("jetson_clocks/jetson_nano_t210_store.conf")
    with pytest.raises(ValueError, match="line 1"):
        parse_store_file("not a store line\n")


def test_tegrastats_agx_r35():
    t = parse_tegrastats(text("tegrastats/agx_orin_r35.txt").strip())
    assert t.timestamp == "04-24-2023 00:01:24" and (t.ram_used_mb, t.ram_total_mb) == (1282, 62795)
    assert len(t.cpus) == 12 and t.cpus[0].freq_mhz == 729
    assert t.emc.load_pct == 0 and t.emc.freq_mhz == (2133,)
    assert t.gpu.freq_mhz == (0,) and t.gpu2 is not None
    assert t.temps_c["CPU"] == pytest.approx(42.593) and t.temps_c["GPU"] is None  # -256C = offline
    assert t.rails["VDD_GPU_SOC"].cur_mw == 2399 and t.rails["VDDQ_VDD2_1V8AO"].avg_mw == 301
    assert "RAM" not in t.rails and "SWAP" not in t.rails


def test_tegrastats_r36_and_loaded():
    t = parse_tegrastats(text("tegrastats/orin_nano_super_r36.txt").strip())
    assert t.gpu.load_pct == 0 and t.gpu.freq_mhz == () and t.emc is None
    assert t.temps_c["tj"] == pytest.approx(48.625)
    assert set(t.rails) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    t = parse_tegrastats(text("tegrastats/orin_nano_r36_loaded.txt").strip())
    assert (t.gpu.load_pct, t.gpu.freq_mhz) == (62, (612,))
    assert t.rails["VDD_SOC"].avg_mw == 1473


def test_tegrastats_jetpack7_gpc_array():
    t = parse_tegrastats(text("tegrastats/agx_orin_jp7.txt").strip())
    assert (t.gpu.load_pct, t.gpu.freq_mhz) == (12, (1300, 1300))
    assert (t.emc.load_pct, t.emc.freq_mhz) == (3, (3199,))
    assert t.rails["VDD_CPU_CV"].cur_mw == 3268 and t.temps_c["cpu"] == pytest.approx(52.968)
    assert t.cpus[0].load_pct == 23
    offline = parse_tegrastats("CPU [1%@729,off,off] GR3D_FREQ 0%@[305]")
    assert offline.cpus[1] is None and offline.gpu.freq_mhz == (305,)


def test_identity_formats():
    r35 = parse_nv_tegra_release(text("identity/nv_tegra_release_r35"))
    assert (r35.release, r35.layout, r35.board) == ("35.4.1", "r35", "t186ref")
    r36 = parse_nv_tegra_release(text("identity/nv_tegra_release_r36"))
    assert (r36.release, r36.layout) == ("36.4.3", "r36")
    with pytest.raises(ValueError):
        parse_nv_tegra_release("Ubuntu 22.04")
    compat = parse_compatible((DATA / "identity" / "compatible_orin_nano_super").read_bytes())
    assert compat == ("nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005", "nvidia,tegra234")
    assert module_from_compatible(compat) == "p3767-0005"
    assert module_from_compatible(("nvidia,p3737-0000+p3701-0004",)) == "p3701-0004"
