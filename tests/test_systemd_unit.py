"""The project's unit (systemd/orin-agent.service, installed by scripts/install.sh) under a real
systemd booted in a container (tests/systemd_container.py), driven by tests/systemd_probe.py:
Type=notify readiness, failing starts, the watchdog, kill -9, `systemctl stop` during a stream, and where the
sandbox lets it write its caches.
One boot serves every test here (~1 min once the root file system is cached).
Marked `systemd`: outside the default run; `python3 -m pytest -m systemd` runs them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from power.twin.driver import reading_files
from systemd_container import REPO, VENV, Boot, boot_and_probe, unavailable

pytestmark = pytest.mark.systemd
UNIT = "orin-agent.service"
STOP_MARGIN_S = 5.0  # restore + ExecStopPost (a Python start-up) + systemd's own bookkeeping
WATCHDOG_MARGIN_S = 2.0


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Boot:
    why = unavailable()
    if why:
        pytest.skip(why)
    b = boot_and_probe(tmp_path_factory.mktemp("systemd"))
    assert b.results.get("done"), f"the probe did not finish (nspawn rc {b.results.get('nspawn_rc')}):\n" \
                                  f"{b.console[-4000:]}"
    print(f"systemd container timings (s): {b.seconds}")
    return b


def text(entry: dict) -> str:
    msg = entry.get("MESSAGE", "")
    return bytes(msg).decode(errors="replace") if isinstance(msg, list) else str(msg)


def unit_lines(b: Boot, since_us: int, until_us: int | None = None) -> list[tuple[int, int, str]]:
    """(time µs, pid, message) of the unit's journal lines, systemd's own (pid 1) and the processes'."""
    out = []
    for e in b.journal:
        if UNIT not in (e.get("_SYSTEMD_UNIT"), e.get("UNIT")):
            continue
        t = int(e["__REALTIME_TIMESTAMP"])
        if t >= since_us and (until_us is None or t < until_us):
            out.append((t, int(e.get("_PID", 0)), text(e)))
    return out


def first(lines: list[tuple[int, int, str]], needle: str, pid: int | None = None) -> tuple[int, int, str]:
    for line in lines:
        if needle in line[2] and (pid is None or line[1] == pid):
            return line
    raise AssertionError(f"no journal line with {needle!r}" + (f" from pid {pid}" if pid else "") + ":\n" +
                         "\n".join(m for _, _, m in lines[-40:]))


def step(b: Boot, name: str) -> dict:
    r = b.results[name]
    assert "probe_error" not in r, r["probe_error"]
    return r


def test_the_install_script_installs_the_projects_unit_and_is_idempotent(boot: Boot) -> None:
    runs = boot.install_log.split("== installed files after run ")[1:]
    assert len(runs) == 2
    sums = [sorted(line.split()[0] for line in run.splitlines()[1:3]) for run in runs]
    assert sums[0] == sums[1], "a second scripts/install.sh changed the installed unit or config"
    installed = boot.unit.splitlines()
    source = (REPO / "systemd" / "orin-agent.service").read_text().splitlines()
    assert [ln for ln in source if "@BIN@" not in ln] == [ln for ln in installed if VENV not in ln]
    assert any(ln.startswith(f"ExecStart={VENV}/bin/orin-agent serve") for ln in installed)


def test_notify_active_only_after_the_model_is_loaded_and_ready_answers(boot: Boot) -> None:
    for name in ("ready_order", "restart_good"):
        r = step(boot, name)
        assert r["rc"] == 0 and r["props"]["ActiveState"] == "active"
        assert r["ready_after_start"] == 200, "`systemctl start` returned before /ready answered"
        states = [s for _, s, _ in r["samples"]]
        assert "activating" in states, "no sample while loading: the check saw no start-up window"
        bad = [(t, s, c) for t, s, c in r["samples"] if s == "active" and c != 200]
        assert not bad, f"active while /ready did not answer 200: {bad}"
    # In the journal: the new process loaded its model before systemd logged the unit as started.
    lines = unit_lines(boot, 0)
    pid = int(step(boot, "restart_good")["props"]["MainPID"])
    loaded = first(lines, "loaded", pid)
    started = [t for t, p, m in lines if p == 1 and m.startswith("Started ") and t >= loaded[0]]
    assert started, "systemd never logged the restarted unit as started after its model loaded"


@pytest.mark.parametrize("name", ["bad_config", "missing_model"])
def test_a_failing_start_fails_the_job_with_one_error_line_and_no_traceback(boot: Boot, name: str) -> None:
    r = step(boot, name)
    assert r["rc"] != 0, "`systemctl start` succeeded with a broken config"
    assert r["right_after"]["Result"] == "exit-code"
    lines = unit_lines(boot, r["since_us"], r["since_us"] + int((r["probe_s"] - 1) * 1e6))
    failed = first(lines, "Main process exited")
    pid = next(p for _, p, m in lines if p != 1 and m.startswith("error: "))
    own = [m for t, p, m in lines if p == pid and t <= failed[0]]
    assert len(own) == 1 and own[0].startswith("error: "), own
    assert "\n" not in own[0]
    assert not any("Traceback" in m for _, _, m in lines)


@pytest.mark.parametrize("name", ["bad_config", "missing_model"])
def test_a_failing_start_leaves_the_unit_failed(boot: Boot, name: str) -> None:
    r = step(boot, name)
    assert r["later"]["ActiveState"] == "failed", r["later"]


def _restored_before_serving(boot: Boot, r: dict) -> None:
    """After a kill: the board was put back (by ExecStopPost, or by the new process first), then served."""
    assert r["restarted"] and r["ready"] == 200, r
    assert r["journaled"] > 0, "the killed run had journaled no board write: nothing was tested"
    assert int(r["props"]["NRestarts"]) == int(r["before"]["NRestarts"]) + 1
    lines = unit_lines(boot, r["since_us"])
    new = int(r["props"]["MainPID"])
    listening = first(lines, "listening on", new)
    by_stop_post = [m for t, p, m in lines if p not in (1, new) and m.startswith("restored ")]
    by_new = [t for t, p, m in lines if p == new and "restoring them first" in m and t < listening[0]]
    assert by_stop_post or by_new, "no restore of the killed run's journal before the new process served"


def test_watchdog_kills_a_stopped_service_and_the_restart_restores_the_board_first(boot: Boot) -> None:
    r = step(boot, "watchdog")
    wd = boot.settings["watchdog_sec"]
    assert wd > 0, "the unit has no WatchdogSec="
    lines = unit_lines(boot, r["since_us"])
    timeout = first(lines, "Watchdog timeout", 1)
    waited = (timeout[0] - r["since_us"]) / 1e6
    assert waited <= wd + WATCHDOG_MARGIN_S, f"systemd noticed the stopped process after {waited:.1f} s"
    _restored_before_serving(boot, r)


def test_kill_9_is_restarted_and_the_board_restored_before_serving(boot: Boot) -> None:
    _restored_before_serving(boot, step(boot, "kill9"))


@pytest.mark.parametrize("name", ["watchdog", "kill9"])
def test_exec_stop_post_restores_the_board_after_a_kill(boot: Boot, name: str) -> None:
    r = step(boot, name)
    lines = unit_lines(boot, r["since_us"])
    new = int(r["props"]["MainPID"])
    assert [m for t, p, m in lines if p not in (1, new) and m.startswith("restored ")], \
        [m for _, _, m in lines[:20]]


def test_stop_during_a_stream_drains_within_the_grace_and_restores_the_tree(boot: Boot,
                                                                           tmp_path: Path) -> None:
    r = step(boot, "stop_stream")
    grace = boot.settings["shutdown_grace_s"]
    assert r["rc"] == 0 and r["props"]["Result"] == "success" and r["props"]["ExecMainStatus"] == "0"
    assert r["stop_s"] <= grace + STOP_MARGIN_S, f"stop took {r['stop_s']:.1f} s (grace {grace} s)"
    assert r["short"]["done"], f"a short stream in flight at the stop was not finished: {r['short']}"
    assert r["chunks"] > r["chunks_at_stop"], "the long stream got nothing after the stop began"
    assert "status=0" in r["props"]["ExecStopPost"], r["props"]["ExecStopPost"]
    assert not r["run_journal_left"]
    lines = unit_lines(boot, r["since_us"])
    first(lines, "board restored")
    assert [m for _, p, m in lines if m.startswith(("nothing to restore", "restored "))], \
        "no output from ExecStopPost's `power restore`"
    # The twin's tree as before the boot, but for the files its own model rewrites as readings (a
    # board's clocks/loads/rails/temperatures move by themselves too; bpmp's emc/rate reports the
    # actual rate once unlocked).
    readings = reading_files(tmp_path)
    # and for the board lock (power.hw.rootlock), which stays, as /run/lock/orin-agent/board.lock does on a board
    assert set(boot.after) - {"run/lock/orin-agent/board.lock"} == set(boot.pristine)
    changed = sorted(k for k in boot.pristine if boot.pristine[k] != boot.after[k] and k not in readings)
    assert not changed, f"settings left changed after the stop: {changed}"


def test_a_stream_cut_by_the_stop_ends_cleanly(boot: Boot) -> None:
    r = step(boot, "stop_stream")
    assert r["error_event"] and r["done"], r
    assert not any("Traceback" in m for _, _, m in unit_lines(boot, r["since_us"]))


def test_under_the_units_sandbox_the_cache_root_is_writable_and_the_home_is_not(boot: Boot) -> None:
    """ProtectHome=read-only makes the unit's ~/.cache read-only: every cache (partition.paths.cache_root) goes to its
    CacheDirectory instead. A process with the installed unit's file-system properties (systemd-run) tries both."""
    r = step(boot, "cache_sandbox")
    assert r["rc"] == 0, r["stderr"]
    assert "--property=ProtectHome=read-only" in r["properties"] and "--property=CacheDirectory=orin-agent" in \
        r["properties"], r["properties"]
    assert r["home_cache"] is False
    assert r["cache_root"] == "/var/cache/orin-agent" and r["cache_root_writable"] is True


def test_systemd_analyze_security_exposure_is_no_worse_than_recorded(boot: Boot) -> None:
    """`systemd-analyze security` inside the container (systemd 252); docs/ON_DEVICE.md records the score
    (4.6 before the least-privilege unit; `--offline=yes` on the bare unit file: 4.8 then, 3.4 now)."""
    m = re.search(r"Overall exposure level for orin-agent\.service: ([0-9.]+)", boot.results["security"])
    assert m, boot.results["security"][-500:]
    assert float(m.group(1)) <= 4.0, m.group(1)
