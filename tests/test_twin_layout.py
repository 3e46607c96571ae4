"""The twin's tree: every board x L4T layout has the real paths, names, units and formats."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from power.physics.boards import BOARDS, L4T_RELEASES, board_for
from power.twin import create_twin, read_meta

CASES = [(b, l) for b in BOARDS for l in L4T_RELEASES]


@pytest.fixture(params=CASES, ids=[f"{b}-{l}" for b, l in CASES])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str, str]:
    board, l4t = request.param
    create_twin(tmp_path, board, l4t)
    return tmp_path, board, l4t


def _r(root: Path, rel: str) -> str:
    return (root / rel).read_text().strip()


def test_identity(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    spec = board_for(board, l4t)
    model = (root / "proc/device-tree/model").read_bytes()
    assert model.endswith(b"\0") and b"Orin" in model
    compat = (root / "proc/device-tree/compatible").read_bytes().split(b"\0")
    assert compat[-1] == b"" and b"nvidia,tegra234" in compat
    assert f"nvidia,{spec.module}".encode() in compat
    assert (root / "proc/device-tree").is_symlink()
    first = (root / "etc/nv_tegra_release").read_text().splitlines()[0]
    m = re.match(r"# R(\d+) \(release\), REVISION: (\d+\.\d+), GCID: \d+, BOARD: \w+, "
                 r"EABI: aarch64, DATE: ", first)
    assert m and f"r{m.group(1)}" == l4t
    assert read_meta(root) == (board, l4t)


def test_gpu_devfreq_is_found_by_of_node(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    spec = board_for(board, l4t)
    gpus = [d for d in (root / "sys/class/devfreq").iterdir()
            if b"nvidia,ga10b" in (d / "device/of_node/compatible").read_bytes()]
    assert len(gpus) == 1 and len(list((root / "sys/class/devfreq").iterdir())) == 2
    node = gpus[0]
    assert node.is_symlink()
    assert node.name == ("17000000.ga10b" if l4t == "r35" else "17000000.gpu")
    assert (node / "device/of_node/name").read_bytes() == b"gpu\0"
    real = {"r35": "sys/devices/17000000.ga10b/devfreq/17000000.ga10b",
            "r36": "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu"}[l4t]
    assert node.resolve() == (root / real).resolve()
    table = [int(x) for x in _r(node, "available_frequencies").split()]
    assert table == sorted(table) == list(spec.gpu_hz)
    assert int(_r(node, "max_freq")) in table and int(_r(node, "min_freq")) == table[0]
    assert _r(node, "governor") == "nvhost_podgov"
    assert "nvhost_podgov" in _r(node, "available_governors").split()
    loads = {"r35": ["sys/devices/gpu.0/load"],
             "r36": ["sys/devices/platform/gpu.0/load", "sys/devices/platform/bus@0/17000000.gpu/load"]}
    for load in loads[l4t]:
        assert 0 <= int(_r(root, load)) <= 1000
    gpu0 = "sys/devices/gpu.0" if l4t == "r35" else "sys/devices/platform/gpu.0"
    assert _r(root, f"{gpu0}/railgate_enable") in ("0", "1")


def test_emc_and_actmon(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    emc = root / "sys/kernel/debug/bpmp/debug/clk/emc"
    for f in ("rate", "min_rate", "max_rate", "mrq_rate_locked"):
        assert int(_r(emc, f)) >= 0
    assert int(_r(emc, "max_rate")) == board_for(board, l4t).emc_max_hz
    assert int(_r(root, "sys/kernel/nvpmodel_emc_cap/emc_iso_cap")) >= 0
    actmon = {"r35": "sys/kernel/actmon_avg_activity/mc_all", "r36": "sys/kernel/debug/cactmon/mc_all"}
    assert int(_r(root, actmon[l4t])) >= 0


def test_cpus(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    spec = board_for(board, l4t)
    cpu = root / "sys/devices/system/cpu"
    assert _r(cpu, "present") == f"0-{spec.cpu_count - 1}"
    for n in range(spec.cpu_count):
        assert _r(cpu, f"cpu{n}/online") in ("0", "1")
        f = cpu / f"cpu{n}/cpufreq"
        assert f.is_symlink()
        table = [int(x) for x in _r(f, "scaling_available_frequencies").split()]
        assert table == sorted(table) and table[0] == 115200
        assert int(_r(f, "scaling_min_freq")) <= int(_r(f, "scaling_max_freq")) <= table[-1]
        assert _r(f, "scaling_governor") == "schedutil"
    assert _r(cpu, "cpu0/online") == "1"
    mode = spec.mode(spec.default_mode)
    online = sum(_r(cpu, f"cpu{n}/online") == "1" for n in range(spec.cpu_count))
    assert online == mode.online_cores


def test_thermal_zones(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    names = {"r35": ["CPU-therm", "GPU-therm", "CV0-therm", "CV1-therm", "CV2-therm", "SOC0-therm",
                     "SOC1-therm", "SOC2-therm", "tj-therm"],
             "r36": ["cpu-thermal", "gpu-thermal", "cv0-thermal", "cv1-thermal", "cv2-thermal",
                     "soc0-thermal", "soc1-thermal", "soc2-thermal", "tj-thermal"]}[l4t]
    zones = sorted((root / "sys/class/thermal").glob("thermal_zone*"), key=lambda p: int(p.name[12:]))
    assert [_r(z, "type") for z in zones] == names
    for z in zones:
        assert int(_r(z, "temp")) == 25000          # m°C
        trips = {}
        n = 0
        while (z / f"trip_point_{n}_type").exists():
            trips[_r(z, f"trip_point_{n}_type")] = int(_r(z, f"trip_point_{n}_temp"))
            int(_r(z, f"trip_point_{n}_hyst"))
            n += 1
        assert trips["critical"] == 104500 and trips["passive"] == 99000


def test_power_rails(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    labels = {}
    for dev in sorted((root / "sys/bus/i2c/drivers/ina3221").iterdir()):
        hw = next((dev / "hwmon").glob("hwmon*"))
        assert _r(hw, "name") == "ina3221"
        assert _r(hw, "in7_label") == "sum of shunt voltages"
        for n in (1, 2, 3):
            labels[(dev.name, n)] = _r(hw, f"in{n}_label")
            for f in (f"in{n}_input", f"curr{n}_input", f"curr{n}_crit"):
                assert int(_r(hw, f)) >= 0
    if board.startswith("agx"):
        assert labels == {("1-0040", 1): "VDD_GPU_SOC", ("1-0040", 2): "VDD_CPU_CV",
                          ("1-0040", 3): "VIN_SYS_5V0", ("1-0041", 1): "NC",
                          ("1-0041", 2): "VDDQ_VDD2_1V8AO", ("1-0041", 3): "NC"}
    else:
        assert labels == {("1-0040", 1): "VDD_IN", ("1-0040", 2): "VDD_CPU_GPU_CV",
                          ("1-0040", 3): "VDD_SOC"}


def test_fan(tree: tuple[Path, str, str]) -> None:
    root, _, _ = tree
    fans = list(root.glob("sys/devices/platform/pwm-fan*/hwmon/hwmon*/pwm1"))
    assert len(fans) == 1 and 0 <= int(fans[0].read_text()) <= 255


def _conf_paths(text: str, l4t: str) -> list[str]:
    """The paths a PARAM section names for one layout (r36 uses the *_KNEXT arguments)."""
    out, in_param = [], False
    for line in text.splitlines():
        if line.startswith("<"):
            in_param = "PARAM" in line
            continue
        parts = line.split()
        if in_param and len(parts) == 2 and parts[1].startswith("/"):
            knext = parts[0].endswith("_KNEXT")
            if (l4t == "r36") == knext or "/cpu/cpu" in parts[1]:
                out.append(parts[1])
    return out


def test_nvpmodel_conf_and_status(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    spec = board_for(board, l4t)
    text = (root / "etc/nvpmodel.conf").read_text()
    assert f"< PM_CONFIG DEFAULT={spec.default_mode} >" in text
    for m in spec.modes:
        assert f"< POWER_MODEL ID={m.id} NAME={m.name} >" in text
    missing = [p for p in _conf_paths(text, l4t) if not (root / p.lstrip("/")).exists()]
    assert not missing, f"nvpmodel.conf names paths the {l4t} tree lacks: {missing}"
    assert re.fullmatch(rf"pmode:{spec.default_mode:04d} fmode:\w+",
                        _r(root, "var/lib/nvpmodel/status"))
    parsers = pytest.importorskip("power.hw.parsers")
    conf = parsers.parse_nvpmodel_conf(text)
    assert [m.id for m in conf.modes] == [m.id for m in spec.modes]


def test_default_mode_applied(tree: tuple[Path, str, str]) -> None:
    root, board, l4t = tree
    spec = board_for(board, l4t)
    mode = spec.mode(spec.default_mode)
    node = next(d for d in (root / "sys/class/devfreq").iterdir() if "17000000" in d.name)
    assert int(_r(node, "max_freq")) == (mode.gpu_max_hz or spec.gpu_max_hz)
    gpu0 = "sys/devices/gpu.0" if l4t == "r35" else "sys/devices/platform/gpu.0"
    assert int(_r(root, f"{gpu0}/tpc_pg_mask")) == mode.tpc_pg_mask


def test_unknown_board_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="agx-orin-64gb"):
        create_twin(tmp_path, "xavier", "r35")
    with pytest.raises(KeyError, match="r35"):
        create_twin(tmp_path, "agx-orin-64gb", "r34")
