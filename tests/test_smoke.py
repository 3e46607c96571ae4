"""`orin-agent smoke` on twins: the board checks pass on every twin board and layout and leave the tree
byte-identical; the whole smoke passes on one; each check broken on purpose fails (or skips) with a
message that names what broke, and the board is still put back."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from agent.config import ServiceConfig
from agent.smoke import BOARD_CHECKS, SmokeOptions, SmokeReport, default_run_dir, run_smoke
from agent.smoke.context import tree_files
from power.twin import BOARDS, L4T_RELEASES, create_twin

GPU_R36 = "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu"


def _twin(tmp_path: Path, board: str = "agx-orin-64gb", l4t: str = "r36") -> Path:
    root = tmp_path / f"{board}-{l4t}"
    create_twin(root, board, l4t)
    return root


def _opts(root: Path, **kw: object) -> SmokeOptions:
    cfg = kw.pop("config", ServiceConfig())
    return SmokeOptions(str(root), default_run_dir(root), cfg, max_tokens=8, profile_dir=None, **kw)  # type: ignore[arg-type]


def _statuses(rep: SmokeReport) -> dict[str, str]:
    return {r.name: r.status for r in rep.results}


@pytest.mark.parametrize("l4t", L4T_RELEASES)
@pytest.mark.parametrize("board", sorted(BOARDS))
def test_board_checks_pass_on_every_twin_and_leave_it_byte_identical(tmp_path: Path, board: str, l4t: str) -> None:
    root = _twin(tmp_path, board, l4t)
    before = tree_files(root)
    rep = run_smoke(_opts(root), only=BOARD_CHECKS)
    st = _statuses(rep)
    assert rep.ok, [(r.name, r.detail) for r in rep.results if r.status == "fail"]
    assert set(st) == BOARD_CHECKS and all(v == "pass" for v in st.values()), st
    for name in ("clock-gpu", "clock-emc", "clock-cpu"):     # the twin's model really settled them
        assert rep.result(name).data["settle_ms"] is not None
    assert tree_files(root) == before


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SmokeReport, dict[str, bytes]]:
    root = _twin(tmp_path_factory.mktemp("full"))
    before = tree_files(root)
    return root, run_smoke(_opts(root)), before


def test_full_smoke_passes_on_a_twin(full: tuple[Path, SmokeReport, dict[str, bytes]]) -> None:
    root, rep, before = full
    st = _statuses(rep)
    assert rep.ok and rep.twin, [(r.name, r.detail) for r in rep.results if r.status == "fail"]
    assert [r.name for r in rep.results] == ["board", "interfaces", "permissions", "clock-gpu", "clock-emc",
                                             "clock-cpu", "sensors", "versions", "tensorrt", "engines",
                                             "generation", "controller", "energy", "ready", "unchanged"]
    for name in ("generation", "controller", "energy", "unchanged"):
        assert st[name] == "pass", rep.result(name).detail
    assert "--build-dir" in rep.result("engines").detail and "--service-url" in rep.result("ready").detail
    gen = rep.result("generation").data
    assert gen["tokens"] == 8 and gen["ttft_s"] > 0 and gen["decode_tok_s"] > 0
    assert rep.result("energy").data["joules_per_token"] > 0 and "simulated" in rep.result("energy").detail
    assert rep.result("controller").data["prefill"] != rep.result("controller").data["decode"]
    assert tree_files(root) == before


def test_cli_json_exit_codes(tmp_path: Path) -> None:
    root = _twin(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["smoke", "--root", str(root), "--json", "--quick"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["simulated"] and doc["checks"][0]["name"] == "board"
    z = root / "sys/class/thermal/thermal_zone1/temp"
    os.unlink(os.path.realpath(z))
    out = runner.invoke(app, ["smoke", "--root", str(root), "--quick"])
    assert out.exit_code == 1 and "offline" in out.stdout


def test_offline_zone_fails_the_sensor_check_by_name(tmp_path: Path) -> None:
    root = _twin(tmp_path)
    (root / "sys/class/thermal/thermal_zone0/temp").resolve().unlink()
    before = tree_files(root)
    rep = run_smoke(_opts(root), only=BOARD_CHECKS)
    sensors = rep.result("sensors")
    assert not rep.ok and sensors.status == "fail"
    assert "zone cpu" in sensors.detail and "offline" in sensors.detail and sensors.remedy
    assert rep.result("unchanged").status == "pass" and tree_files(root) == before


def test_read_only_clock_file_fails_the_round_trip_and_changes_nothing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root = _twin(tmp_path)
    before = tree_files(root)
    real_open = os.open

    def read_only_max_freq(path, flags, *a):  # noqa: ANN001, ANN202 - os.open's own signature
        if str(path).endswith(f"{GPU_R36}/max_freq") and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only_max_freq)
    rep = run_smoke(_opts(root), only=BOARD_CHECKS)
    monkeypatch.undo()
    gpu = rep.result("clock-gpu")
    assert gpu.status == "fail" and "permission denied" in gpu.detail and "max_freq" in gpu.detail
    assert rep.result("clock-cpu").status == "pass" and rep.result("unchanged").status == "pass"
    assert tree_files(root) == before


def test_no_debugfs_skips_the_emc_with_the_reason_and_passes(tmp_path: Path) -> None:
    import shutil

    root = _twin(tmp_path)
    shutil.rmtree(root / "sys/kernel/debug")
    rep = run_smoke(_opts(root), only=BOARD_CHECKS)
    emc = rep.result("clock-emc")
    assert rep.ok and emc.status == "skip" and "debugfs" in emc.detail
    assert "EMC clock" in rep.result("interfaces").detail


def test_no_nvpmodel_conf_fails_the_controller_by_name(tmp_path: Path, tiny_checkpoint: Path) -> None:
    root = _twin(tmp_path)
    (root / "etc/nvpmodel.conf").unlink()
    before = tree_files(root)
    rep = run_smoke(_opts(root, config=ServiceConfig(model_dir=tiny_checkpoint)),
                    only=BOARD_CHECKS | {"generation", "controller"})
    ctl = rep.result("controller")
    assert "nvpmodel.conf" in rep.result("interfaces").detail
    assert not rep.ok and ctl.status == "fail" and "nvpmodel.conf is missing" in ctl.detail
    assert rep.result("generation").status == "pass" and tree_files(root) == before


@pytest.fixture()
def build(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    from partition.build import build_slices

    out = tmp_path / "build"
    build_slices(tiny_checkpoint, "0:2,2:4", out, verify=False)
    return out


def _engines(root: Path, build: Path, model: Path) -> SmokeReport:
    return run_smoke(_opts(root, config=ServiceConfig(model_dir=model), build_dir=build), only=frozenset({"engines"}))


def test_engines_match_the_manifest(tmp_path: Path, build: Path, tiny_checkpoint: Path) -> None:
    rep = _engines(_twin(tmp_path), build, tiny_checkpoint)
    assert rep.result("engines").status == "pass" and rep.result("engines").data["slices"] == 2


def test_missing_engine_fails(tmp_path: Path, build: Path, tiny_checkpoint: Path) -> None:
    (build / "slice_02_04.onnx").unlink()
    eng = _engines(_twin(tmp_path), build, tiny_checkpoint).result("engines")
    assert eng.status == "fail" and "slice_02_04.onnx is missing" in eng.detail and "orin-agent build" in eng.remedy


def test_manifest_mismatch_fails(tmp_path: Path, build: Path, tiny_checkpoint: Path) -> None:
    doc = json.loads((build / "manifest.json").read_text())
    doc["model_hash"] = "0" * len(doc["model_hash"])
    (build / "manifest.json").write_text(json.dumps(doc))
    eng = _engines(_twin(tmp_path), build, tiny_checkpoint).result("engines")
    assert eng.status == "fail" and "different weights" in eng.detail


def test_a_running_service_holding_the_board_skips_the_writes(tmp_path: Path) -> None:
    from power.hw.journal import Journal

    root = _twin(tmp_path)
    held = Journal(default_run_dir(root), root)      # what a running service holds
    try:
        rep = run_smoke(_opts(root), only=BOARD_CHECKS)
    finally:
        held.close()
    st = _statuses(rep)
    assert rep.ok and st["clock-gpu"] == st["clock-emc"] == st["clock-cpu"] == st["unchanged"] == "skip"
    assert "in use" in rep.result("clock-gpu").detail and "another process" in rep.result("clock-gpu").detail


def test_cli_missing_root_is_a_one_line_error(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["smoke", "--root", str(tmp_path / "nope")])
    assert out.exit_code == 2 and "no such directory" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "nope").exists()
