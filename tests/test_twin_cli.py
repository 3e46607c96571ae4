"""`orin-agent twin create / run`: clear errors, no tracebacks, a working tree."""
from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from agent.cli import app

runner = CliRunner()


def test_bad_board_lists_valid_ones(tmp_path: Path) -> None:
    r = runner.invoke(app, ["twin", "create", str(tmp_path / "t"), "--board", "xavier"])
    assert r.exit_code == 2
    assert "agx-orin-64gb" in r.output and "orin-nano-8gb" in r.output
    assert "Traceback" not in r.output


def test_bad_l4t(tmp_path: Path) -> None:
    r = runner.invoke(app, ["twin", "create", str(tmp_path / "t"), "--l4t", "r34"])
    assert r.exit_code == 2 and "r35" in r.output


def test_run_on_a_folder_that_is_not_a_twin(tmp_path: Path) -> None:
    r = runner.invoke(app, ["twin", "run", str(tmp_path), "--duration", "0.1"])
    assert r.exit_code == 2 and "twin create" in r.output and "Traceback" not in r.output


def test_create_then_run(tmp_path: Path) -> None:
    d = tmp_path / "orin"
    r = runner.invoke(app, ["twin", "create", str(d), "--board", "orin-nx-16gb", "--l4t", "r35",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert (d / "etc/nvpmodel.conf").exists()
    (d / "run/orin-agent-twin/workload.json").write_text('{"phase": "decode", "gpu_util": 1.0, '
                                                        '"mem_util": 0.7}')
    r = runner.invoke(app, ["twin", "run", str(d), "--duration", "0.3", "--period", "0.05"])
    assert r.exit_code == 0, r.output
    assert "stopped:" in r.output
    assert (d / "sys/devices/gpu.0/load").read_text().strip() == "1000"
