"""Runs INSIDE the booted test container (stdlib only), called by tests/systemd_probe.py when the boot
asks for chaos cycles: the chaos loop of scripts/chaos_test.py under the real systemd. Each cycle sends
SIGKILL, SIGTERM, SIGSTOP -> SIGCONT -> SIGTERM or SIGSTOP -> SIGKILL to the unit's main process at a
random moment (start-up included) while streaming clients run; after a kill the unit's Restart= brings
it back (after its ExecStopPost put the board back), after a SIGTERM (exit 0: no restart) the probe
starts it again. It records, per cycle, what systemd says, each request's end, and the twin's files
that differ from the tree after the first clean stop, read once the stop has settled (ExecStopPost
done, before the restart). Every judgement is the host test's (tests/test_systemd_chaos.py).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from systemd_probe import AUTH, OUT, SETTINGS, UNIT, URL, http_status, sh, show, wait_for

ACTIONS = ("SIGKILL", "SIGTERM", "SIGSTOP+SIGCONT+SIGTERM", "SIGSTOP+SIGKILL")
KILLS = {"SIGKILL", "SIGSTOP+SIGKILL"}
HANG_S = 30.0
TWIN = Path(SETTINGS["twin_root"])
PROMPTS = ("def parse(", "import os\n", "class Cache:", "for i in range(")


def digests() -> dict[str, str]:
    """sha256 of every regular file of the twin outside run/ (relative path -> hex)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(TWIN):
        if os.path.relpath(dirpath, TWIN) == ".":
            dirnames[:] = [d for d in dirnames if d != "run"]
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, TWIN)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def one_request(stream: bool, max_tokens: int, prompt: str) -> tuple[str, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(URL + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "Connection": "close", **AUTH})
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            if not stream:
                doc = json.loads(r.read())
                return ("complete", "200") if doc.get("choices") else ("cut", "no choices")
            finished = errored = False
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if finished:
                        return "complete", "200"
                    return ("clean_error", "sse-error") if errored else ("cut", "[DONE] without an end")
                doc = json.loads(line[6:])
                errored |= "error" in doc
                finished |= any(ch.get("finish_reason") for ch in doc.get("choices", []))
            return "cut", "no [DONE]"
    except urllib.error.HTTPError as exc:
        exc.read()
        return "clean_error", str(exc.code)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (ConnectionRefusedError, FileNotFoundError)):
            return "refused", ""
        if isinstance(exc.reason, (socket.timeout, TimeoutError)):
            return "hung", str(exc.reason)
        return "cut", repr(exc.reason)
    except (socket.timeout, TimeoutError) as exc:
        return "hung", repr(exc)
    except (ConnectionError, http.client.HTTPException, ValueError, OSError) as exc:
        return "cut", repr(exc)


def client(stop: threading.Event, out: list[dict], rng: random.Random) -> None:
    while not stop.is_set():
        r = {"started": time.monotonic()}
        out.append(r)
        r["outcome"], r["detail"] = one_request(rng.random() < 0.8, rng.randint(4, 40), rng.choice(PROMPTS))
        r["ended"] = time.monotonic()
        if r["outcome"] == "refused":
            time.sleep(0.2)


def health() -> bool:
    if http_status("/health", 10) != 200:
        return False
    return one_request(False, 4, "def f(")[0] == "complete"


def settle(kill: bool, timeout: float = 90) -> bool:
    """Wait until the stop has settled (ExecStopPost done): after a kill, waiting to restart; after a
    clean exit, inactive, or waiting to restart too when the exit came before READY=1 (systemd counts a
    Type=notify service that exits during its start as a failed start, result 'protocol')."""
    if kill:
        return wait_for(lambda: show("SubState")["SubState"] == "auto-restart", timeout, 0.05)
    return wait_for(lambda: show("ActiveState")["ActiveState"] in ("inactive", "failed")
                    or show("SubState")["SubState"] == "auto-restart", timeout, 0.05)


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler yet (SigCgt, proc(5)); before agent.boot's first line
    the interpreter is still starting and SIGTERM's default action ends it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def _gone(pid: int) -> bool:
    """Reaped by systemd: every thread has exited, so its sockets are closed. (The thread group's leader
    turns zombie first, while other threads may still hold the listening socket open: a connection made
    then is accepted by the kernel and reset a moment later.)"""
    return not os.path.exists(f"/proc/{pid}")


def cycle(n: int, action: str, start_up: bool, rng: random.Random) -> dict:
    rec: dict = {"n": n, "action": action, "start_up": start_up, "t_start_us": time.time_ns() // 1000}
    state = show("ActiveState")["ActiveState"]
    if state == "failed":
        sh("systemctl", "reset-failed", UNIT)
    if state not in ("active", "activating"):
        sh("systemctl", "start", "--no-block", UNIT)
    elif start_up and state == "active":  # a start-up to hit: systemd's own stop and start first
        sh("systemctl", "restart", "--no-block", UNIT)
        wait_for(lambda: show("ActiveState")["ActiveState"] == "activating", 60, 0.05)
    wait_for(lambda: show("MainPID")["MainPID"] not in ("", "0"), 60, 0.05)
    t0 = time.monotonic()
    stop, reqs = threading.Event(), []
    threads = [threading.Thread(target=client, args=(stop, reqs, random.Random(rng.random())), daemon=True)
               for _ in range(rng.randint(2, 4))]
    for t in threads:
        t.start()
    if start_up:
        time.sleep(rng.uniform(0.3, 2.5))
        rec["state_at_signal"] = show("ActiveState")["ActiveState"]
    else:
        rec["ready"] = wait_for(lambda: show("ActiveState")["ActiveState"] == "active"
                                and http_status("/ready", 2) == 200, 180, 0.1)
        rec["health_ok"] = health()
        time.sleep(rng.uniform(0.2, 3.0))
    before = show("MainPID", "NRestarts")
    pid = int(before["MainPID"] or 0)
    rec["signal_at_s"] = round(time.monotonic() - t0, 3)
    gone_at = None
    if pid:
        if action in ("SIGKILL", "SIGTERM"):
            rec["before_first_line"] = action == "SIGTERM" and not catches_sigterm(pid)
            os.kill(pid, signal.SIGKILL if action == "SIGKILL" else signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.2, 2.0))
            if action == "SIGSTOP+SIGKILL":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGCONT)
                time.sleep(rng.uniform(0.0, 1.0))
                rec["before_first_line"] = not catches_sigterm(pid)
                os.kill(pid, signal.SIGTERM)
        wait_for(lambda: _gone(pid), 60, 0.02)
        gone_at = time.monotonic()
    rec["settled"] = settle(action in KILLS)
    rec["after"] = show("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus", "NRestarts")
    rec["changed"] = sorted(k for k, v in digests().items() if BASELINE.get(k) != v)
    rec["gone"] = sorted(set(BASELINE) - set(digests()))
    rec["journal_left"] = Path("/run/orin-agent/journal.json").exists()
    if action in KILLS or rec["after"].get("SubState") == "auto-restart":
        # Restart= brings it back (the next cycle waits for it to serve, or hits its start-up)
        rec["restarted"] = wait_for(lambda: show("ActiveState")["ActiveState"] in ("activating", "active")
                                    and show("MainPID")["MainPID"] not in ("", "0", str(pid)), 60, 0.05)
        rec["nrestarts"] = [int(before["NRestarts"] or 0), int(show("NRestarts")["NRestarts"] or 0)]
    stop.set()
    for t in threads:
        t.join(HANG_S + 10)
    outcomes: dict[str, int] = {}
    for r in reqs:
        o = r.get("outcome", "hung")
        if o == "cut" and action in KILLS and gone_at is not None and r["started"] <= gone_at:
            o = "cut_at_kill"
        outcomes[o] = outcomes.get(o, 0) + 1
        if o in ("cut", "hung"):
            rec.setdefault("bad_requests", []).append(
                f"{r.get('detail', '')} (started {r['started'] - t0:.2f} s, ended {r.get('ended', 0) - t0:.2f} s)")
    rec["outcomes"] = outcomes
    rec["seconds"] = round(time.monotonic() - t0, 2)
    rec["t_end_us"] = time.time_ns() // 1000
    rec["gone_at_s"] = None if gone_at is None else round(gone_at - t0, 3)
    return rec


BASELINE: dict[str, str] = {}


def chaos(cycles: int, seed: int = 28) -> dict:
    """The whole loop; returns what the host test judges."""
    global BASELINE
    rng = random.Random(seed)
    sh("systemctl", "stop", UNIT, timeout=120)  # a clean stop first: ExecStopPost, the board as it was
    BASELINE = digests()
    recs, actions = [], []
    t0 = time.monotonic()
    for n in range(cycles):
        if not actions:
            actions = rng.sample(ACTIONS, len(ACTIONS))
        try:
            recs.append(cycle(n, actions.pop(), n % 5 == 1, rng))
        except Exception as exc:  # noqa: BLE001 - recorded for the host-side test
            recs.append({"n": n, "probe_error": repr(exc)})
        (OUT / "chaos.json").write_text(json.dumps({"cycles": recs}, indent=1))
    wait_for(lambda: show("ActiveState")["ActiveState"] in ("active", "inactive", "failed"), 120)
    if show("ActiveState")["ActiveState"] != "active":
        sh("systemctl", "reset-failed", UNIT)
        sh("systemctl", "start", UNIT, timeout=300)
    final = {"health_ok": health()}
    sh("systemctl", "stop", UNIT, timeout=120)
    final["changed"] = sorted(k for k, v in digests().items() if BASELINE.get(k) != v)
    final["after"] = show("ActiveState", "Result", "ExecMainStatus")
    return {"cycles": recs, "final": final, "baseline": BASELINE, "seconds": round(time.monotonic() - t0, 1)}
