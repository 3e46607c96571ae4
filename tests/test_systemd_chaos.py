"""The chaos loop under the real systemd (tests/systemd_container.py boots it, tests/systemd_chaos_probe.py
drives it): 50 cycles of SIGKILL / SIGTERM / SIGSTOP+SIGCONT+SIGTERM / SIGSTOP+SIGKILL to the unit's
main process at random moments, start-up included, under streaming clients, with the unit's Restart=
doing the restarts after a kill and its ExecStopPost the restore. After every cycle, once the stop had
settled: no board file the agent may write differs from the tree after the first clean stop; every
request ended complete or with a clean error (those cut by a SIGKILL counted apart), none hung; each
kill was restarted by systemd; each SIGTERM exited 0. Marked `systemd` (root, nspawn, debootstrap);
about 15-25 minutes on a 2-core machine, so it is not part of .ci/run's systemd block.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agent.smoke.context import settable_files
from power.hw.backends import SysfsBoard
from power.twin import create_twin
from power.twin.driver import reading_files
from systemd_container import boot_and_probe, unavailable

pytestmark = pytest.mark.systemd


def unit_lines(journal: list[dict], since_us: int, until_us: int) -> list[tuple[int, str, str]]:
    """(time µs, pid, message) of orin-agent.service's journal lines between two times."""
    out = []
    for e in journal:
        if "orin-agent.service" not in (e.get("_SYSTEMD_UNIT"), e.get("UNIT")):
            continue
        t, msg = int(e["__REALTIME_TIMESTAMP"]), e.get("MESSAGE", "")
        if since_us <= t <= until_us:
            out.append((t, str(e.get("_PID", "")), bytes(msg).decode(errors="replace") if isinstance(msg, list)
                        else str(msg)))
    return out
CYCLES = 50
KILLS = {"SIGKILL", "SIGSTOP+SIGKILL"}


def test_fifty_chaos_cycles_under_systemd_leave_the_board_as_it_was(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    b = boot_and_probe(tmp_path / "systemd", chaos_cycles=CYCLES)
    chaos = b.results.get("chaos", {})
    assert b.results.get("done") and "probe_error" not in chaos, \
        f"{chaos.get('probe_error', '')}\nnspawn rc {b.results.get('nspawn_rc')}:\n{b.console[-4000:]}"
    host_twin = tmp_path / "twin"
    create_twin(host_twin, "agx-orin-64gb", "r36")  # the container's twin: the same board and layout
    readings = reading_files(tmp_path / "scratch")
    settable = {p.lstrip("/") for p in settable_files(SysfsBoard(host_twin))} - readings

    # the baseline (after the first clean stop) is the tree as it was before the boot
    pristine = {k: hashlib.sha256(v).hexdigest() for k, v in b.pristine.items() if not k.startswith("run/")}
    base = chaos["baseline"]
    assert sorted(k for k in set(pristine) | set(base) if k not in readings and pristine.get(k) != base.get(k)) == []

    bad: list[str] = []
    totals: dict[str, int] = {}
    protocol_restarts = leaked_total = 0
    for c in chaos["cycles"]:
        where = f"cycle {c['n']} ({c.get('action')}{' in start-up' if c.get('start_up') else ''})"
        if "probe_error" in c:
            bad.append(f"{where}: {c['probe_error']}")
            continue
        for k, v in c["outcomes"].items():
            totals[k] = totals.get(k, 0) + v
        leaked = [p for p in c["changed"] + c["gone"] if p in settable]
        leaked_total += len(leaked)
        other = [p for p in c["changed"] + c["gone"] if p not in settable and p not in readings
                 and not p.endswith(".twin-tmp")]
        if not c["settled"]:
            bad.append(f"{where}: the stop never settled: {c['after']}")
        if leaked or other:
            bad.append(f"{where}: board files differ after the stop: {leaked + other}")
        if c["journal_left"] and c["action"] not in KILLS:
            bad.append(f"{where}: a journal was left after a clean stop")
        if c["action"] in KILLS:
            if not c.get("restarted") or c["nrestarts"][1] <= c["nrestarts"][0]:
                bad.append(f"{where}: Restart= did not bring it back: {c['after']} {c.get('nrestarts')}")
        elif (c["after"].get("ExecMainCode"), c["after"].get("ExecMainStatus")) != ("1", "0") and not (
                c.get("before_first_line") and c["after"].get("ExecMainStatus") == "15"):
            bad.append(f"{where}: not exit status 0 after SIGTERM: {c['after']}")  # (killed by it only
            # when it came before agent.boot's first line: the interpreter still starting)
        elif c["after"].get("Result") == "protocol":
            # exit 0 before READY=1: systemd counts the start as failed and Restart= restarts it
            # (`systemctl stop` during a start does not: systemd is stopping it then)
            protocol_restarts += 1
            if not c.get("restarted"):
                bad.append(f"{where}: exited 0 in start-up and was not restarted: {c['after']}")
        if c.get("health_ok") is False or c.get("ready") is False:
            bad.append(f"{where}: /ready, /health or the first request failed once active")
        if c["outcomes"].get("cut") or c["outcomes"].get("hung"):
            lines = [f"  {(t - c['t_start_us']) / 1e6:7.2f} s pid {p}: {m[:120]}" for t, p, m in
                     unit_lines(b.journal, c["t_start_us"], c["t_end_us"])]
            bad.append(f"{where}: requests cut / hung: {c['outcomes']} {c.get('bad_requests', [])[:3]}; signal "
                       f"at {c['signal_at_s']} s, gone at {c.get('gone_at_s')} s; the unit's journal then:\n"
                       + "\n".join(lines[-30:]))
    final = chaos["final"]
    if not final["health_ok"] or [p for p in final["changed"] if p not in readings]:
        bad.append(f"final start / stop: {final}")
    summary = {"cycles": len(chaos["cycles"]), "seconds": chaos["seconds"], "outcomes": totals,
               "actions": {a: sum(c.get("action") == a for c in chaos["cycles"]) for a in
                           ("SIGKILL", "SIGTERM", "SIGSTOP+SIGCONT+SIGTERM", "SIGSTOP+SIGKILL")},
               "start_up": sum(bool(c.get("start_up")) for c in chaos["cycles"]),
               "restarts_by_systemd": sum(bool(c.get("restarted")) for c in chaos["cycles"]),
               "sigterm_in_start_up_restarted": protocol_restarts,
               "sigterm_before_first_line": sum(bool(c.get("before_first_line")) for c in chaos["cycles"]),
               "leaked_settings": leaked_total, "hung": totals.get("hung", 0), "cut": totals.get("cut", 0),
               "cut_at_kill": totals.get("cut_at_kill", 0), "failures": len(bad)}
    print(json.dumps(summary))  # the numbers docs/BENCHMARKS.md records
    assert not bad, "\n".join(bad[:30]) + "\n" + json.dumps(summary)
    assert len(chaos["cycles"]) >= CYCLES and totals.get("complete", 0) > CYCLES
