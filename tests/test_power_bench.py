"""Twin tests of the power controller (phase events produce the expected files within the settle
time; errors leave no clock changed), the energy benchmark on a short trace, and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from power.runtime.applier import ClockApplier, read_zone_samples, tables_from_board
from power.runtime.loop import PowerLoop
from power.runtime.board import open_board_at
from power.bench.energy import BenchConfig, compare, run_bench
from power.physics.boards import BOARDS
from power.policy.dvfs import DvfsController, Planner
from power.policy.phase import PhaseEvent
from power.hw.errors import BoardWriteError
from power.policy.profiles import ProfileStore
from power.bench.traces import make_trace
from power.twin import Twin, create_twin
from power.runtime.shapes import model_shape

SPEC = BOARDS["agx-orin-64gb"]
GPU_DEVFREQ = "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu"
EMC = "sys/kernel/debug/bpmp/debug/clk/emc"


def _loop(root: Path, profile: str = "balanced") -> tuple[PowerLoop, ClockApplier]:
    board = open_board_at(root)
    applier = ClockApplier(board, board.writer(root / "run" / "orin-agent"))
    applier.set_mode("MAXN", allow_reboot=True)     # the twin reboots for free
    board = open_board_at(root)
    applier.board = board
    ctl = DvfsController(tables_from_board(board, SPEC.emc_hz), Planner.for_board(SPEC, model_shape("llama-3-8b"), "int4", 0))
    return PowerLoop(ctl, ProfileStore(None).load(profile), applier, lambda: read_zone_samples(board)), applier


def _read(root: Path, rel: str) -> int:
    return int((root / rel).read_text().split()[0])


def test_phase_events_produce_the_expected_files_within_settle_time(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    loop, applier = _loop(tmp_path)
    twin = Twin(tmp_path)
    d = loop.on_event(PhaseEvent("prefill", 512), 0.0)
    assert _read(tmp_path, f"{GPU_DEVFREQ}/max_freq") == d.gpu_max_hz > 1.0e9
    assert _read(tmp_path, f"{EMC}/mrq_rate_locked") == 1 and _read(tmp_path, f"{EMC}/rate") == d.emc_hz
    twin.read_limits()
    twin.step(0.008)            # ORIN.md: a new GPU clock in ~5 ms, EMC ~8 ms
    twin.flush()
    assert _read(tmp_path, f"{GPU_DEVFREQ}/cur_freq") == d.gpu_max_hz
    d = loop.on_event(PhaseEvent("decode", context=600), 0.3)
    twin.read_limits()
    twin.step(0.008)
    twin.flush()
    assert _read(tmp_path, f"{GPU_DEVFREQ}/cur_freq") == d.gpu_max_hz < 0.6 * SPEC.gpu_max_hz
    assert _read(tmp_path, f"{EMC}/rate") == SPEC.emc_max_hz
    loop.on_event(PhaseEvent("idle"), 1.0)
    loop.tick(1.0 + loop.profile.timing.idle_hold_s)        # within 1 s of going idle
    assert _read(tmp_path, f"{GPU_DEVFREQ}/max_freq") == SPEC.gpu_hz[0]
    assert _read(tmp_path, f"{EMC}/rate") == SPEC.emc_hz[0]
    writes = applier.writes
    loop.tick(5.0)
    assert applier.writes == writes         # nothing changed: nothing written
    applier.restore()
    assert _read(tmp_path, f"{EMC}/mrq_rate_locked") == 0
    assert not (tmp_path / "run" / "orin-agent" / "journal.json").exists()


def test_write_error_restores_every_file(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    before = (tmp_path / GPU_DEVFREQ / "max_freq").read_text()
    loop, applier = _loop(tmp_path)
    loop.on_event(PhaseEvent("prefill", 512), 0.0)
    rate = tmp_path / EMC / "rate"
    rate.unlink()
    rate.mkdir()                            # EISDIR on the next EMC write
    with pytest.raises(BoardWriteError):
        loop.on_event(PhaseEvent("decode", context=100), 1.0)
    assert (tmp_path / GPU_DEVFREQ / "max_freq").read_text() == before


def test_offline_zone_reported_by_the_loop(tmp_path: Path) -> None:
    create_twin(tmp_path, "agx-orin-64gb", "r36")
    Twin(tmp_path).fail_zone("gpu")
    loop, applier = _loop(tmp_path)
    d = loop.on_event(PhaseEvent("decode", context=100), 0.0)
    assert d.message and "gpu" in d.message and "offline" in d.message
    applier.restore()


def test_traces_are_seeded() -> None:
    assert make_trace("chat", 600, 1) == make_trace("chat", 600, 1) != make_trace("chat", 600, 2)
    with pytest.raises(ValueError, match="allowed: chat, rag, batch"):
        make_trace("nope", 10)


def test_bench_short_trace() -> None:
    res = run_bench(BenchConfig(duration_s=90, policies=("maxn+jetson_clocks", "balanced")))
    by = {r.policy: r for r in res}
    assert by["balanced"].joules_per_token < by["maxn+jetson_clocks"].joules_per_token
    assert by["balanced"].output_tokens == by["maxn+jetson_clocks"].output_tokens > 0
    assert by["balanced"].switch_cost_us is not None
    c = compare(res)
    assert c["balanced"]["tpot_p95_pct"] < 5.0


def test_cli_bench_json_and_files(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "power", "--duration", "60", "--json", "--out", str(tmp_path),
                                 "--policy", "maxn+jetson_clocks", "--policy", "eco", "--profile-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["policy"] for x in recs] == ["maxn+jetson_clocks", "eco"] and all("joules_per_token" in x for x in recs)
    assert (tmp_path / "power-chat-25C.json").exists() and (tmp_path / "power-chat-25C.png").stat().st_size > 0



def test_cli_bench_writes_to_the_cache_not_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    r = CliRunner().invoke(app, ["bench", "power", "--duration", "30", "--policy", "maxn+jetson_clocks",
                                 "--no-plot", "--profile-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    written = cache / "orin-agent" / "bench-power" / "power-chat-25C.json"
    assert written.exists() and str(written) in r.output and list(work.iterdir()) == []


def test_cli_bench_bad_input_exit_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "power", "--trace", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "allowed: chat, rag, batch" in r.output
    r = CliRunner().invoke(app, ["bench", "power", "--board", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "agx-orin-64gb" in r.output


def test_cli_profiles_show_set_state_restore(tmp_path: Path) -> None:
    run = CliRunner()
    r = run.invoke(app, ["power", "profiles", "--json", "--profile-dir", str(tmp_path)])
    assert r.exit_code == 0 and {p["name"] for p in json.loads(r.stdout)} == {"balanced", "eco", "max", "performance"}
    r = run.invoke(app, ["power", "show", "eco", "--json", "--profile-dir", str(tmp_path)])
    assert r.exit_code == 0 and json.loads(r.stdout)["latency"]["tpot_slack"] == 0.25
    r = run.invoke(app, ["power", "show", "nope", "--profile-dir", str(tmp_path)])
    assert r.exit_code == 2 and "allowed: balanced, eco, max, performance" in r.output
    root = tmp_path / "twin"
    create_twin(root, "agx-orin-64gb", "r36")
    before = (root / GPU_DEVFREQ / "max_freq").read_text()
    args = ["--root", str(root), "--run-dir", str(tmp_path / "run"), "--profile-dir", str(tmp_path)]
    r = run.invoke(app, ["power", "set", "eco", *args])
    assert r.exit_code == 0, r.output
    assert _read(root, f"{GPU_DEVFREQ}/max_freq") == SPEC.gpu_hz[0]
    r = run.invoke(app, ["power", "state", "--run-dir", str(tmp_path / "run"), "--json"])
    assert json.loads(r.stdout)["profile"] == "eco"
    r = run.invoke(app, ["power", "restore", "--root", str(root), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0 and (root / GPU_DEVFREQ / "max_freq").read_text() == before
