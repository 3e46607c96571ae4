"""`orin-agent bench run` on a twin: report.json, the four PNGs and summary.md, the numbers marked as
simulated, energy per phase accounted, and the default output folder never the current one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.benchmark.run import default_out_dir
from agent.cli import app
from power.twin import create_twin


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> tuple[Path, Path, dict]:
    base = tmp_path_factory.mktemp("bench")
    root, out = base / "twin", base / "out"
    create_twin(root, "agx-orin-64gb", "r36")
    (base / "agent.toml").write_text(f'[model]\ndir = "{tiny_checkpoint}"\n')
    res = CliRunner().invoke(app, ["bench", "run", "--root", str(root), "--trace", "sparse", "--profile", "balanced",
                                   "--profile", "max", "--config", str(base / "agent.toml"), "--out", str(out),
                                   "--profile-dir", str(base / "none")])
    assert res.exit_code == 0, res.output
    assert "Simulated" in res.stdout
    return root, out, json.loads((out / "report.json").read_text())


def test_writes_the_report_plots_and_summary(bench: tuple[Path, Path, dict]) -> None:
    _, out, doc = bench
    for name in ("report.json", "summary.md", "clocks.png", "power.png", "temperature.png", "energy_per_token.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "clocks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "summary.md").read_text()
    assert md.count("](") >= 5 and "Simulated" in md and "| balanced |" in md
    assert doc["simulated"] is True and set(doc["plots"]) == {"clocks", "power", "temperature", "energy"}


def test_numbers_per_profile_and_phase(bench: tuple[Path, Path, dict]) -> None:
    _, _, doc = bench
    assert [p["profile"] for p in doc["profiles"]] == ["balanced", "max"]
    for p in doc["profiles"]:
        assert p["requests"] == 3 and p["tokens_generated"] == 3 * 24
        assert p["energy_j"]["decode"] > 0 and p["energy_j"]["prefill"] > 0 and p["energy_j"]["idle"] > 0
        assert p["joules_per_token"] == pytest.approx((p["energy_j"]["prefill"] + p["energy_j"]["decode"]) / 72, rel=1e-3)
        assert p["ttft_p50_s"] > 0 and p["tpot_p50_ms"] > 0 and p["controller_error"] is None
    mx = doc["profiles"][1]["clocks_in_force_mhz"]
    assert mx["prefill"]["gpu_max_mhz"] == mx["decode"]["gpu_max_mhz"]     # max pins the GPU at its top


def test_board_restored_after_the_benchmark(bench: tuple[Path, Path, dict]) -> None:
    root, _, _ = bench
    assert not (root / "run" / "orin-agent" / "journal.json").exists()


def test_default_output_is_under_the_cache_not_the_current_folder(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    d = default_out_dir("chat")
    assert "orin-agent" in d.parts and "bench" in d.parts and tmp_path not in d.parents
