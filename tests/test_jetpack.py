"""JetPack 5/6 field situations on the twin (or with a fake Runner / BoardIO): Python 3.10, a torch-free
power half, containers (no debugfs, no nvpmodel.conf), per-board mode names, journaled and safe mode
switches, kernel clamps, offline clusters, external changes, jtop, jetson_clocks and r36 paths."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from power.runtime.applier import ClockApplier, tables_from_board
from power.runtime.session import open_session, spec_of
from power.hw import backends
from power.hw.backends import JtopBoard, SysfsBoard, open_board
from power.hw.errors import ToolError
from power.hw.journal import BoardIO, restore_run_dir
from power.hw.parsers import parse_nvpmodel_conf
from power.physics.boards import BOARDS, NANO_SUPER
from power.policy.dvfs import Decision
from power.twin import create_twin

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _bytes(root: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under ``root`` (restore must leave them all as before),
    but the board lock (run/lock/orin-agent/, power.hw.rootlock), which stays, as on a board."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            if os.path.relpath(p, root).startswith("run/lock/orin-agent/"):
                continue
            out[os.path.relpath(p, root)] = os.readlink(p) if os.path.islink(p) else Path(p).read_bytes()
    return out


def _set(root: Path, run: Path, profile: str = "balanced", *extra: str) -> dict:
    res = runner.invoke(app, ["power", "set", profile, "--root", str(root), "--run-dir", str(run), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# -- Python 3.10 and a torch-free power half -------------------------------------------------------

def test_the_toml_readers_fall_back_to_tomli_where_tomllib_is_missing() -> None:
    pytest.importorskip("tomli")
    code = ("import sys; sys.modules['tomllib'] = None; sys.version_info = (3, 10, 13)\n"    # as on 3.10
            "from power.policy.profiles import ProfileStore\n"
            "import agent.config\n"
            "print(ProfileStore(None).load('balanced').nvpmodel)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "max"


def test_no_file_of_the_tree_needs_python_311() -> None:
    vermin = shutil.which("vermin") or pytest.skip("vermin is not installed (the CI's 3.10 tier runs it)")
    out = subprocess.run([vermin, "-q", "--no-tips", "--violations", "--target=3.10-", "--eval-annotations",
                          "agent", "power", "partition", "kernels", "tests", "setup.py"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("modules", [
    "power.runtime.session, power.runtime.controller, power.runtime.status, agent.cli.power, agent.cli.twin",
    "agent.api",
])
def test_the_power_half_and_the_api_import_no_torch(modules: str) -> None:
    code = (f"import sys, {modules}\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnxruntime', 'transformers'))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_file_of_the_torchfree_tier_exists() -> None:
    listed = [ln for ln in (ROOT / "tests/torchfree.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert listed and all((ROOT / f).is_file() for f in listed)


# -- containers, flashed boards and per-board mode names ------------------------------------------

@pytest.mark.parametrize("board,l4t,opts,warn", [
    ("agx-orin-64gb", "r36", {"debugfs": False}, "nvpmodel_clk_cap/emc"),
    ("agx-orin-64gb", "r35", {"debugfs": False}, "EMC skipped"),
    ("agx-orin-64gb", "r36", {"nvpmodel_conf": "absent"}, "no /etc/nvpmodel.conf"),
    ("orin-nx-16gb", "r36", {"nvpmodel_conf": "absent", "debugfs": False}, "no /etc/nvpmodel.conf"),
])
def test_power_set_applies_what_the_board_offers_and_restore_is_exact(tmp_path: Path, board: str, l4t: str,
                                                                      opts: dict, warn: str) -> None:
    root, run = tmp_path / "root", tmp_path / "run"
    create_twin(root, board, l4t, **opts)
    before = _bytes(root)
    out = _set(root, run)
    assert warn in out["warning"]
    st = runner.invoke(app, ["power", "status", "--root", str(root), "--run-dir", str(run), "--json"])
    assert st.exit_code == 0 and warn in " ".join(json.loads(st.stdout)["controller"]["warnings"])
    assert warn in runner.invoke(app, ["power", "status", "--root", str(root), "--run-dir", str(run)]).stdout
    assert runner.invoke(app, ["power", "restore", "--root", str(root), "--run-dir", str(run)]).exit_code == 0
    assert _bytes(root) == before


def test_without_debugfs_r36_caps_the_emc_through_clk_cap(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36", debugfs=False)
    out = _set(tmp_path, tmp_path / "run", "eco")
    assert int((tmp_path / "sys/kernel/nvpmodel_clk_cap/emc").read_text()) == out["decision"]["emc_hz"]


def test_the_absolute_nvpmodel_conf_symlink_resolves_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    create_twin(root, "agx-orin-64gb", "r36", nvpmodel_conf="symlink")
    assert os.readlink(root / "etc/nvpmodel.conf").startswith("/etc/nvpmodel/")
    board = SysfsBoard(root)
    assert board.nvpmodel.available and board.nvpmodel.conf().default_id == 2
    before = _bytes(root)
    _set(root, tmp_path / "run", "balanced", "--allow-reboot-modes")
    assert board.read_mode().name == "MAXN"
    assert restore_run_dir(tmp_path / "run", root).ok and _bytes(root) == before


def test_nvidias_header_without_a_space_parses() -> None:
    conf = parse_nvpmodel_conf("<PARAM TYPE=CLOCK NAME=EMC >\nMAX_FREQ /sys/kernel/nvpmodel_clk_cap/emc\n"
                               "< POWER_MODEL ID=0 NAME=MAXN >\nEMC MAX_FREQ 0\n< PM_CONFIG DEFAULT=0 >\n")
    assert conf.params["EMC"].paths("MAX_FREQ") == ("/sys/kernel/nvpmodel_clk_cap/emc",)


@pytest.mark.parametrize("board,l4t,key,want", [
    ("agx-orin-64gb", "r36", "max", "MAXN"), ("agx-orin-64gb", "r36", "default", "MODE_30W"),
    ("orin-nano-8gb", "r35", "max", "15W"), ("orin-nano-8gb", "r36", "max", "MAXN_SUPER"),
    ("orin-nx-16gb", "r35", "1", "10W"), ("orin-nano-8gb", "r35", "MAXN", None),
])
def test_symbolic_modes_resolve_from_the_boards_conf(tmp_path: Path, board: str, l4t: str, key: str,
                                                     want: str | None) -> None:
    create_twin(tmp_path, board, l4t)
    m = SysfsBoard(tmp_path).nvpmodel.conf().resolve(key)
    assert (m.name if m else None) == want


def test_orin_nano_r35_power_set_balanced_and_an_unknown_mode_is_a_warning(tmp_path: Path) -> None:
    root, run = tmp_path / "root", tmp_path / "run"
    create_twin(root, "orin-nano-8gb", "r35")
    before = _bytes(root)
    assert _set(root, run)["warnings"] == []          # "max" is 15W there
    assert restore_run_dir(run, root).ok and _bytes(root) == before
    prof_dir = tmp_path / "profiles"
    prof_dir.mkdir()
    (prof_dir / "maxn.toml").write_text('include = "balanced"\nnvpmodel = "MAXN"\n')
    out = _set(root, run, "maxn", "--profile-dir", str(prof_dir))
    assert "no such mode" in out["warning"] and "15W" in out["warning"]
    assert restore_run_dir(run, root).ok and _bytes(root) == before


def test_r36_nano_is_super_only_when_the_board_says_so(tmp_path: Path) -> None:
    create_twin(tmp_path, "orin-nano-8gb", "r36")
    assert spec_of(SysfsBoard(tmp_path)) is NANO_SUPER
    dt = tmp_path / "sys/firmware/devicetree/base/model"
    dt.write_bytes(BOARDS["orin-nano-8gb"].model.encode() + b"\0")          # a JetPack 6.0 Nano
    conf = tmp_path / "etc/nvpmodel.conf"
    conf.write_text(conf.read_text().replace("MAXN_SUPER", "MODE_X"))
    assert spec_of(SysfsBoard(tmp_path)) is BOARDS["orin-nano-8gb"]


# -- mode switches: reboot-needing refused, real-tool switches journaled --------------------------

def test_a_tpc_mask_switch_is_refused_unless_allowed(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")          # boots in MODE_30W, TPC mask 240
    out = _set(tmp_path, tmp_path / "run")
    assert "--allow-reboot-modes" in out["warning"] and SysfsBoard(tmp_path).read_mode().name == "MODE_30W"
    assert restore_run_dir(tmp_path / "run", tmp_path).ok
    _set(tmp_path, tmp_path / "run", "balanced", "--allow-reboot-modes")
    assert SysfsBoard(tmp_path).read_mode().name == "MAXN"


class FakeTools:
    """The real tools' contract (writes that bypass the journal), recorded instead of run."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls = root, []

    def __call__(self, args, timeout_s, writer=None) -> str:
        self.calls.append(list(args))
        if args[:2] == ["nvpmodel", "-m"]:
            (self.root / "var/lib/nvpmodel/status").write_text(f"pmode:{int(args[2]):04d} fmode:cool\n")
        if args[:2] == ["nvpmodel", "-q"]:
            raise ToolError("no nvpmodel -q here")
        return ""


class RecordingIO(BoardIO):
    def __init__(self, root: Path) -> None:
        self.root, self.modes, self.stores = root, [], []

    def set_mode(self, mode_id: int) -> None:
        self.modes.append(mode_id)
        (self.root / "var/lib/nvpmodel/status").write_text(f"pmode:{mode_id:04d} fmode:cool\n")

    def jetson_clocks_restore(self, store_file: str) -> None:
        self.stores.append(store_file)


def test_a_real_nvpmodel_switch_is_journaled_and_restore_switches_back(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    tools, io = FakeTools(tmp_path), RecordingIO(tmp_path)
    board = SysfsBoard(tmp_path, runner=tools)
    w = board.writer(tmp_path / "run", io=io)
    board.set_mode(3, w)                                          # MODE_50W, by the "real" tool
    assert ["nvpmodel", "-m", "3"] in tools.calls
    assert [e.role for e in w.journal.entries] == ["mode"]
    w.journal.close()
    assert restore_run_dir(tmp_path / "run", tmp_path, io=io).ok
    assert io.modes == [2] and "pmode:0002" in (tmp_path / "var/lib/nvpmodel/status").read_text()


def test_jetson_clocks_state_is_stored_in_the_run_dir_and_restored_with_the_tool(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    tools, io = FakeTools(tmp_path), RecordingIO(tmp_path)
    board = SysfsBoard(tmp_path, runner=tools)
    w = board.writer(tmp_path / "run", io=io)
    board.set_jetson_clocks(w)
    store = str((tmp_path / "run" / "jetson_clocks.store").resolve())
    assert ["jetson_clocks", "--store", store] in tools.calls and tools.calls[-1] == ["jetson_clocks"]
    w.journal.close()
    assert restore_run_dir(tmp_path / "run", tmp_path, io=io).ok and io.stores == [store]


# -- kernel clamps, offline clusters, external changes -------------------------------------------

def test_a_kernel_clamp_is_reported_not_fatal(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    cap = BOARDS["agx-orin-64gb"].gpu_hz[5]

    class QosLimited(BoardIO):      # a PM QoS limit holds devfreq's max_freq at ``cap``
        def write(self, host_path, data, *, create=False):
            if host_path.endswith("17000000.gpu/max_freq") and int(data) > cap:
                data = f"{cap}\n".encode()
            super().write(host_path, data, create=create)

    board = SysfsBoard(tmp_path)
    a = ClockApplier(board, board.writer(tmp_path / "run", io=QosLimited()))
    low, top = board.info.gpu.available_hz[0], board.info.gpu.available_hz[-1]
    a.apply(Decision("prefill", low, top, 2133000000, 1728000, None, 0, False, "test"))
    assert any("clamped by the kernel" in n and str(cap) in n for n in a.notes)
    a.restore()


def test_offline_clusters_without_a_table_are_skipped(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    (tmp_path / "sys/devices/system/cpu/cpufreq/policy8/scaling_available_frequencies").write_text("")
    board = SysfsBoard(tmp_path)
    a = ClockApplier(board, board.writer(tmp_path / "run"))
    t = tables_from_board(board, BOARDS["agx-orin-64gb"].emc_hz)
    a.apply(Decision("idle", t.gpu_hz[0], t.gpu_hz[0], t.emc_hz[0], t.cpu_khz[-1], None, 0, False, "test"))
    a.restore()


def test_a_write_is_repeated_after_another_tool_changed_the_clock(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    session = open_session(tmp_path, tmp_path / "run", "balanced", profile_dir=None)
    g = session.board.info.gpu
    d = Decision("idle", g.available_hz[0], g.available_hz[0], session.tables.emc_hz[0], session.tables.cpu_khz[-1],
                 None, 0, False, "test")
    session.applier.apply(d)
    max_freq = tmp_path / g.devfreq.lstrip("/") / "max_freq"
    max_freq.write_text(f"{g.available_hz[-1]}\n")               # jtop / jetson_clocks by hand
    assert session.applier.apply(d) >= 1 and int(max_freq.read_text()) == g.available_hz[0]
    session.applier.restore()
    session.close()


# -- jtop and r36 paths ---------------------------------------------------------------------------

def test_a_jtop_version_mismatch_falls_back_to_sysfs_in_auto_mode(tmp_path: Path, monkeypatch) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")

    class JtopException(Exception):
        pass

    def refuse():
        raise JtopException("Mismatch version jtop service: [4.2] and client: [4.3]")
    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=refuse, JtopException=JtopException))
    monkeypatch.setattr(backends, "jtop_available", lambda root: True)
    assert open_board(tmp_path).backend == "sysfs"
    with pytest.raises(OSError, match="jtop service"):
        open_board(tmp_path, backend="jtop")


def test_jtop_total_is_vdd_in_and_a_dead_jtop_reads_sysfs(tmp_path: Path) -> None:
    create_twin(tmp_path, "orin-nano-8gb", "r35")

    class Dead(Exception):
        pass

    jet = types.SimpleNamespace(
        power={"rail": {"VDD_CPU_GPU_CV": {"volt": 5000, "curr": 400}, "VDD_SOC": {"volt": 5000, "curr": 300}},
               "tot": {"name": "VDD_IN", "volt": 5000, "curr": 1200}},
        temperature={"cpu": {"temp": 99.0}}, fan=types.SimpleNamespace(profile="quiet", speed=10),
        ok=lambda: True)
    board = JtopBoard(jet, tmp_path, errors=(Dead,))
    assert backends.PowerRails.total_mw(board.read_rails()) == 6000.0       # VDD_IN, not 2000+1500
    assert [z.temp_c for z in board.read_zones()] == [99.0]

    def dead():
        raise Dead("jtop thread died")
    jet.ok = dead
    assert [z.temp_c for z in board.read_zones()][:1] == [25.0]               # the tree's ambient
    jet.ok = lambda: True
    board.set_fan(255, board.writer(tmp_path / "run"))
    assert jet.fan.profile == "manual" and jet.fan.speed == 100


def test_r36_gpu_devfreq_dev_and_fan_tachometer_fallbacks(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    shutil.rmtree(tmp_path / "sys/class/devfreq")
    os.unlink(tmp_path / "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/device")
    tach = tmp_path / "sys/devices/platform/39c0000.tachometer/hwmon/hwmon9"
    tach.mkdir(parents=True)
    (tach / "name").write_text("generic_pwm_tachometer\n")
    (tach / "rpm").write_text("2400\n")
    os.symlink(os.path.relpath(tach, tmp_path / "sys/class/hwmon"), tmp_path / "sys/class/hwmon/hwmon9")
    board = SysfsBoard(tmp_path)
    assert board.info.gpu.available_hz and board.info.gpu.devfreq is not None
    assert board.info.fan.rpm == "/sys/class/hwmon/hwmon9/rpm"


def test_non_editable_defaults_do_not_point_into_a_checkout() -> None:
    from partition import paths
    assert paths.shipped_model_dir() in (Path(paths.__file__).resolve().parent / "shipped_models" / "stdlib-llama-8l",
                                         ROOT / "models" / "stdlib-llama-8l")
    assert (paths.DEFAULT_MODEL_DIR / "config.json").is_file()
    setup = (ROOT / "setup.py").read_text()
    assert '"partition.shipped_models": "models"' in setup
