"""Runs INSIDE the booted test container (stdlib only, Debian's python3), as a oneshot unit ordered
after orin-agent.service: drives the real systemd through the scenarios of tests/test_systemd_unit.py
(start ordering, failing starts, watchdog kill, stop during a stream, kill -9), writes what it saw to
/out/results.json and the boot's journal to /out/journal.json, then powers the container off.
The host side (tests/systemd_container.py) only sets up and reads; every judgement is in the tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

UNIT = "orin-agent.service"
CONFIG = Path("/etc/orin-agent/agent.toml")
OUT = Path("/out")
SETTINGS = json.loads((OUT / "settings.json").read_text())
URL = f"http://127.0.0.1:{SETTINGS['port']}"
RUN_JOURNAL = Path("/run/orin-agent/journal.json")


def _auth() -> dict[str, str]:
    """The bearer token the installed config asks for (server.token or server.token_file), if any."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin (guarded by the version check)
    else:  # Python 3.10
        import tomli as tomllib

    server = tomllib.loads(CONFIG.read_text()).get("server", {})
    token = server.get("token") or ""
    if not token and server.get("token_file"):
        token = Path(server["token_file"]).read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


AUTH = _auth()


def sh(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def show(*props: str) -> dict[str, str]:
    out = sh("systemctl", "show", UNIT, *(f"-p{p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def http_status(path: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(URL + path, headers=AUTH), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def now_us() -> int:
    return time.time_ns() // 1000


def wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


class Stream(threading.Thread):
    """One streaming completion, read chunk by chunk; records when chunks came and how it ended."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = json.dumps({"prompt": "def parse(", "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0, "stream": True}).encode()
        self.chunks = 0
        self.done = False
        self.error_event = False
        self.ended: str | None = None
        self.first = threading.Event()

    def run(self) -> None:
        req = urllib.request.Request(URL + "/v1/completions", data=self.body,
                                     headers={"Content-Type": "application/json", **AUTH})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for raw in r:
                    line = raw.decode(errors="replace").strip()
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data:"):
                        self.chunks += 1
                        self.error_event |= '"error"' in line
                        if self.chunks >= 3:
                            self.first.set()
            self.ended = "eof"
        except (OSError, ValueError) as exc:
            self.ended = f"{type(exc).__name__}: {exc}"
        self.first.set()


def start_sampled() -> dict:
    """`systemctl start` (blocking, as a user would) while a sampler records (ActiveState, /ready)."""
    samples: list[tuple[float, str, int | None]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            state = show("ActiveState")["ActiveState"]
            # state first, then /ready: once `active` was seen, /ready must answer.
            code = http_status("/ready", 5 if state == "active" else 0.3)
            samples.append((time.monotonic(), state, code))
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    t.start()
    r = sh("systemctl", "start", UNIT, timeout=300)
    t_ret = time.monotonic()
    ready_after = http_status("/ready", 5)
    time.sleep(0.3)
    stop.set()
    t.join(10)
    p = show("ActiveEnterTimestamp", "MainPID", "ActiveState")
    return {"rc": r.returncode, "start_s": t_ret - t0, "ready_after_start": ready_after,
            "samples": [(round(a - t0, 3), s, c) for a, s, c in samples], "props": p}


def bad_start(text: str) -> dict:
    """Start with a broken config: the start job's result, the state right after and RestartSec later."""
    sh("systemctl", "stop", UNIT)
    CONFIG.write_text(text)
    since = now_us()
    r = sh("systemctl", "start", UNIT, timeout=300)
    right_after = show("ActiveState", "SubState", "Result", "NRestarts")
    time.sleep(SETTINGS["restart_sec"] + 3)
    later = show("ActiveState", "SubState", "Result", "NRestarts")
    sh("systemctl", "stop", UNIT)
    sh("systemctl", "reset-failed", UNIT)
    return {"rc": r.returncode, "since_us": since, "right_after": right_after, "later": later}


def wait_restarted(old_pid: str, timeout: float) -> dict:
    ok = wait_for(lambda: (lambda p: p["ActiveState"] == "active" and p["MainPID"] not in ("0", old_pid))(
        show("ActiveState", "MainPID")), timeout, 0.2)
    return {"restarted": ok, "t_active": time.monotonic(), "ready": http_status("/ready", 5),
            "props": show("ActiveState", "MainPID", "NRestarts", "Result")}


def journal_entries() -> list:
    try:
        return json.loads(RUN_JOURNAL.read_text()).get("entries", [])
    except (OSError, ValueError):
        return []


def kill_scenario(sig: str) -> dict:
    """A stream in flight with the controller's writes journaled, then SIG`sig` to the main process."""
    before = show("MainPID", "NRestarts")
    s = Stream(400)
    s.start()
    s.first.wait(60)
    wait_for(lambda: bool(journal_entries()), 10)
    entries = journal_entries()
    since = now_us()
    t_kill = time.monotonic()
    os.kill(int(before["MainPID"]), getattr(signal, f"SIG{sig}"))
    res = wait_restarted(before["MainPID"], 90)
    s.join(5)
    res.update(before=before, since_us=since, journaled=len(entries), t_to_active=res["t_active"] - t_kill)
    return res


def stop_during_stream() -> dict:
    """A long stream (cut at the grace) and a short one (finishes within it), then `systemctl stop`."""
    s = Stream(1000)
    s.start()
    s.first.wait(60)
    short = Stream(24)
    short.start()
    short.first.wait(60)
    chunks_at_stop = s.chunks
    since = now_us()
    t0 = time.monotonic()
    r = sh("systemctl", "stop", UNIT, timeout=120)
    stop_s = time.monotonic() - t0
    s.join(10)
    short.join(10)
    return {"rc": r.returncode, "stop_s": stop_s, "short": {"chunks": short.chunks, "done": short.done,
                                                            "ended": short.ended}, "since_us": since, "chunks_at_stop": chunks_at_stop,
            "chunks": s.chunks, "done": s.done, "error_event": s.error_event, "ended": s.ended,
            "props": show("ActiveState", "Result", "ExecMainStatus", "ExecStopPost"),
            "run_journal_left": RUN_JOURNAL.exists()}


# Under the unit's sandbox (its file-system properties, from the installed unit): may the home cache and the one
# partition.paths.cache_root picks be written?
CACHE_PROBE = r"""
import json, pathlib
from partition.paths import cache_root
def writable(d):
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / "probe").write_text("ok")
        return True
    except OSError:
        return False
print(json.dumps({"home_cache": writable(pathlib.Path.home() / ".cache" / "orin-agent" / "probe"),
                  "cache_root": str(cache_root()), "cache_root_writable": writable(cache_root() / "probe")}))
"""


def cache_sandbox() -> dict:
    props = ["ProtectSystem", "ProtectHome", "CacheDirectory", "PrivateTmp", "User"]
    shown = show(*props)
    args = [f"--property={p}={shown[p]}" for p in props if shown.get(p)]
    r = sh("systemd-run", "--wait", "--pipe", "--collect", "--quiet", *args,
           f"{SETTINGS['venv']}/bin/python", "-c", CACHE_PROBE)
    out = {"rc": r.returncode, "properties": args, "stderr": r.stderr[-2000:]}
    if r.returncode == 0 and r.stdout.strip():
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    results: dict = {"boot": show("ActiveState", "Result", "MainPID")}
    if SETTINGS.get("chaos_cycles"):  # a boot for the chaos loop only (tests/test_systemd_chaos.py)
        from systemd_chaos_probe import chaos

        t = time.monotonic()
        try:
            results["chaos"] = chaos(int(SETTINGS["chaos_cycles"]))
        except Exception:  # noqa: BLE001 - recorded for the host-side test
            results["chaos"] = {"probe_error": traceback.format_exc()}
        results["chaos_s"] = round(time.monotonic() - t, 1)
        results["done"] = True
        (OUT / "results.json").write_text(json.dumps(results, indent=1))
        return
    good = CONFIG.read_text()
    steps = [
        ("ready_order", lambda: (sh("systemctl", "stop", UNIT), start_sampled())[1]),
        ("bad_config", lambda: bad_start(good + "\n[extra]\nbogus_key = 1\n")),
        ("missing_model", lambda: bad_start(good.replace(SETTINGS["model_dir"], "/opt/orin-agent/models/none"))),
        ("restart_good", lambda: (CONFIG.write_text(good), start_sampled())[1]),
        ("watchdog", lambda: kill_scenario("STOP")),
        ("kill9", lambda: kill_scenario("KILL")),
        ("stop_stream", stop_during_stream),
        ("cache_sandbox", cache_sandbox),
    ]
    for name, step in steps:
        t = time.monotonic()
        try:
            results[name] = step()
        except Exception:  # noqa: BLE001 - recorded for the host-side test, then the next step runs
            results[name] = {"probe_error": traceback.format_exc()}
        results[name]["probe_s"] = round(time.monotonic() - t, 2)
        (OUT / "results.json").write_text(json.dumps(results, indent=1))
    CONFIG.write_text(good)
    results["security"] = sh("systemd-analyze", "security", "--no-pager", UNIT).stdout
    results["done"] = True
    (OUT / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    try:
        main()
    finally:
        (OUT / "journal.json").write_text(sh("journalctl", "-b", "-o", "json", "--no-pager", timeout=60).stdout)
        os.sync()
        subprocess.run(["systemctl", "poweroff", "--no-block"], check=False)
