"""Chaos run of the service: `orin-agent serve` on one twin, stopped each cycle by a random SIGKILL,
SIGTERM, SIGSTOP -> SIGCONT -> SIGTERM or SIGSTOP -> SIGKILL at a random moment (start-up included)
under concurrent streaming clients, then restarted on the same root and run directory.

After every cycle, once recovery ran (the service's own stop; after a kill, alternately the unit's
ExecStopPost `orin-agent power restore` or the next start's own recovery, run as a start with power
control off that is then stopped), it checks that every board file the agent may write is byte for
byte as in the tree before the first start (the twin's own readings aside), that no temp file of a
killed write is left, and that every request ended with a complete answer or a clean error (an HTTP
status, or an SSE error event then [DONE]); none may hang past the timeout. A SIGTERM must exit 0,
unless it came before the process had a handler (the interpreter still starting, before agent.boot's
first line: read from /proc/PID/status), which is counted apart. A request cut without a
clean end is a failure unless a SIGKILL came while it was in flight (counted apart). Each cycle that
reaches serving first checks /health and one request. Exit status 0 only with no failure.

    python scripts/chaos_test.py --cycles 200 --json          # the shipped model
    python scripts/chaos_test.py --cycles 20 --model DIR --seed 7
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ACTIONS = ("SIGKILL", "SIGTERM", "SIGSTOP+SIGCONT+SIGTERM", "SIGSTOP+SIGKILL")
KILLS = {"SIGKILL", "SIGSTOP+SIGKILL"}
HANG_S = 30.0          # no byte of an answer for this long: the request hung
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 40.0  # SIGTERM to exit: the default 10 s grace, uvicorn's 5 s backstop, and slack
START_UP_EVERY = 5     # one cycle in five gets its signal during start-up
PROMPTS = ("def parse(", "import os\n", "class Cache:", "for i in range(", "# read the file\n")
RECOVER_CONFIG = "[board]\npower_control = false\n"  # a start that only recovers: it writes no clock


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler yet (its SigCgt mask, proc(5)): from agent.boot's
    first line on it has; before, the interpreter is still starting and SIGTERM's default kills it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Req:
    started: float
    ended: float = 0.0
    outcome: str = ""   # complete | clean_error | cut | hung | refused
    detail: str = ""


@dataclass
class Cycle:
    n: int
    action: str
    during_start_up: bool
    signal_at_s: float = 0.0           # after the spawn
    exit_code: int | None = None
    recovery: str = ""
    health_ok: bool | None = None      # /health and one request, once serving (None: killed in start-up)
    leaked: list[str] = field(default_factory=list)
    other_changed: list[str] = field(default_factory=list)
    temps_left: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    journaled_at_kill: int = 0         # board files a kill left changed (the journal's entries): recovery's work
    before_first_line: bool = False    # SIGTERM came while the interpreter was still starting (no handler yet)
    bad_requests: list[str] = field(default_factory=list)  # each cut / hung request: what it saw, when (s after spawn)


def _client(url: str, stop: threading.Event, out: list[Req], rng: random.Random) -> None:
    """Requests until `stop`: mostly streamed, each on a new connection (no keep-alive reuse race)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    timeout = httpx.Timeout(HANG_S, connect=5.0)
    with httpx.Client(base_url=url, limits=limits, timeout=timeout) as c:
        while not stop.is_set():
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 40), "temperature": 0,
                    "stream": rng.random() < 0.8}
            r = Req(time.monotonic())
            out.append(r)
            try:
                if body["stream"]:
                    r.outcome, r.detail = _streamed(c, body)
                else:
                    resp = c.post("/v1/completions", json=body)
                    ok = resp.status_code == 200 and resp.json().get("choices")
                    r.outcome = "complete" if ok else "clean_error" if resp.status_code >= 400 else "cut"
                    r.detail = str(resp.status_code)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                r.outcome = "refused"
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                r.outcome = "hung"
            except (httpx.TransportError, json.JSONDecodeError) as exc:
                r.outcome, r.detail = "cut", type(exc).__name__
            r.ended = time.monotonic()
            if r.outcome == "refused":
                time.sleep(0.2)


def _streamed(c: httpx.Client, body: dict) -> tuple[str, str]:
    with c.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return ("clean_error" if resp.status_code >= 400 else "cut"), str(resp.status_code)
        finished = errored = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if finished:
                    return "complete", "200"
                return ("clean_error", "sse-error") if errored else ("cut", "[DONE] without an end")
            doc = json.loads(data)
            if "error" in doc:
                errored = True
            elif any(ch.get("finish_reason") for ch in doc.get("choices", [])):
                finished = True
        return "cut", "stream ended without [DONE]"


class Chaos:
    def __init__(self, model: Path, work: Path, clients: tuple[int, int], seed: int, log: Path) -> None:
        from power.hw.backends import SysfsBoard
        from power.twin import create_twin
        from power.twin.driver import reading_files, tree_bytes
        from agent.smoke.context import settable_files

        self.model, self.work, self.clients, self.rng = model, work, clients, random.Random(seed)
        self.root, self.run = work / "board", work / "run"
        create_twin(self.root, "agx-orin-64gb", "r36")
        self.pristine = tree_bytes(self.root)
        self.readings = reading_files(work / "scratch")
        self.settable = {p.lstrip("/") for p in settable_files(SysfsBoard(self.root))} - self.readings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("ab")
        (work / "recover.toml").write_text(RECOVER_CONFIG)
        self.start_up_s = 5.0  # refined by the first start
        self._actions: list[str] = []

    def _spawn(self, *extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "agent", "serve", "--model", str(self.model), "--root",
                                 str(self.root), "--run-dir", str(self.run), "--port", str(self.port), *extra],
                                cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        end = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return False

    def _health(self) -> bool:
        try:
            h = httpx.get(f"{self.url}/health", timeout=10)
            r = httpx.post(f"{self.url}/v1/completions", json={"prompt": "def f(", "max_tokens": 4}, timeout=HANG_S)
            return h.status_code == 200 and r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    def _stop(self, proc: subprocess.Popen[bytes], sig: int) -> int:
        proc.send_signal(sig)
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            return -999  # did not stop in time

    def cycle(self, n: int) -> Cycle:
        rng = self.rng
        if not self._actions:  # each block of four cycles: the four actions in a random order
            self._actions = rng.sample(ACTIONS, len(ACTIONS))
        c = Cycle(n, self._actions.pop(), n % START_UP_EVERY == 1)
        stop, reqs, threads = threading.Event(), [], []
        t0 = time.monotonic()
        proc = self._spawn()
        for i in range(rng.randint(*self.clients)):
            t = threading.Thread(target=_client, args=(self.url, stop, reqs, random.Random(rng.random())), daemon=True)
            t.start()
            threads.append(t)
        gone_at = None  # when a killed process was gone: requests started before then had no one to answer
        if c.during_start_up:
            time.sleep(rng.uniform(0.3, self.start_up_s))  # from 0.3 s: the interpreter's own start runs first
        else:
            if not self._wait_ready(proc):
                c.health_ok = False
            else:
                if n == 0:
                    self.start_up_s = time.monotonic() - t0
                c.health_ok = self._health()
                time.sleep(rng.uniform(0.2, 3.0))
        c.signal_at_s = round(time.monotonic() - t0, 3)
        if c.action == "SIGKILL":
            c.exit_code = self._stop(proc, signal.SIGKILL)
            gone_at = time.monotonic()
        elif c.action == "SIGTERM":
            c.before_first_line = not catches_sigterm(proc.pid)
            c.exit_code = self._stop(proc, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.2, 2.0))
            if c.action == "SIGSTOP+SIGKILL":
                c.exit_code = self._stop(proc, signal.SIGKILL)
                gone_at = time.monotonic()
            else:
                proc.send_signal(signal.SIGCONT)
                time.sleep(rng.uniform(0.0, 1.0))
                c.before_first_line = not catches_sigterm(proc.pid)
                c.exit_code = self._stop(proc, signal.SIGTERM)
        stop.set()
        for t in threads:
            t.join(HANG_S + 30)
        for r in reqs:
            if r.outcome == "cut" and gone_at is not None and r.started <= gone_at:
                r.outcome = "cut_at_kill"  # in flight when the process was killed: nothing could answer
            c.outcomes[r.outcome or "hung"] = c.outcomes.get(r.outcome or "hung", 0) + 1
            if (r.outcome or "hung") in ("cut", "hung"):
                c.bad_requests.append(f"{r.outcome or 'hung'}: {r.detail or '?'}, {r.started - t0:.3f}-"
                                      f"{(r.ended or time.monotonic()) - t0:.3f} s")
        self._recover(c)
        self._compare(c)
        return c

    def _recover(self, c: Cycle) -> None:
        journal = self.run / "journal.json"
        if c.action not in KILLS:
            c.recovery = "own stop" + (" (journal left!)" if journal.exists() else "")
            return
        try:
            c.journaled_at_kill = len(json.loads(journal.read_text())["entries"])
        except (OSError, ValueError, KeyError):
            c.journaled_at_kill = 0
        if c.n % 2 == 0:
            c.recovery = "power restore"
            r = subprocess.run([sys.executable, "-m", "agent", "power", "restore", "--run-dir", str(self.run)],
                               cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, timeout=120)
            if r.returncode != 0:
                c.recovery += f" (exit {r.returncode}!)"
            return
        c.recovery = "next start"
        proc = self._spawn("--config", str(self.work / "recover.toml"))
        ok = self._wait_ready(proc)
        rc = self._stop(proc, signal.SIGTERM)
        if not ok or rc != 0:
            c.recovery += f" (ready {ok}, exit {rc}!)"

    def _compare(self, c: Cycle) -> None:
        from power.twin.driver import tree_bytes

        now = tree_bytes(self.root)
        keys = (set(self.pristine) | set(now))
        # Left out: run/ (journal, state, lock), the twin model's readings (a board's move by themselves
        # too) and its .twin-tmp files (the simulated kernel's own atomic writes of readings, which a
        # kill mid-flush leaves and its next flush replaces; a board's kernel writes in place).
        changed = sorted(k for k in keys if not k.startswith("run/") and k not in self.readings
                         and not k.endswith(".twin-tmp") and self.pristine.get(k) != now.get(k))
        c.leaked = [k for k in changed if k in self.settable]
        c.other_changed = [k for k in changed if k not in self.settable]
        c.temps_left = sorted(str(p.relative_to(self.work)) for p in self.run.glob(".*.tmp")) if self.run.exists() else []

    def final(self) -> Cycle:
        """A last start: ready, /health and a request, SIGTERM, the board compared."""
        c = Cycle(-1, "SIGTERM", False)
        proc = self._spawn()
        c.health_ok = self._wait_ready(proc) and self._health()
        c.exit_code = self._stop(proc, signal.SIGTERM)
        c.recovery = "own stop"
        self._compare(c)
        return c


def exit_ok(c: Cycle) -> bool:
    """-9 after a kill; 0 after SIGTERM (-15 too when it came before the first line of ours had run)."""
    if c.action in KILLS:
        return c.exit_code == -9
    return c.exit_code == 0 or (c.before_first_line and c.exit_code == -15)


def failures(c: Cycle) -> list[str]:
    bad = []
    if not exit_ok(c):
        bad.append(f"exit {c.exit_code} after {c.action} (want {-9 if c.action in KILLS else 0})")
    if c.health_ok is False:
        bad.append("/health or the first request failed once serving")
    if "!" in c.recovery:
        bad.append(f"recovery: {c.recovery}")
    for what in ("leaked", "other_changed", "temps_left"):
        if getattr(c, what):
            bad.append(f"{what}: {getattr(c, what)[:4]}")
    for k in ("cut", "hung"):
        if c.outcomes.get(k):
            seen = [b for b in c.bad_requests if b.startswith(k)][:4]
            bad.append(f"{c.outcomes[k]} request(s) {k} ({'; '.join(seen)})")
    return [f"cycle {c.n} ({c.action}{' in start-up' if c.during_start_up else ''} at {c.signal_at_s} s): {b}"
            for b in bad]


def run_chaos(model: Path, cycles: int, clients: tuple[int, int] = (4, 8), seed: int = 0,
              work: Path | None = None, on_cycle: Callable[[Cycle], None] | None = None) -> dict:
    """``cycles`` chaos cycles and a final clean start and stop in ``work`` (a temp folder, removed
    when nothing failed); returns the report (numbers, failures by cycle)."""
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="orin-agent-chaos-")) if work is None else work
    t0 = time.monotonic()
    chaos = Chaos(model, work, clients, seed, work / "service.log")
    done: list[Cycle] = []
    try:
        for n in range(cycles):
            done.append(chaos.cycle(n))
            if on_cycle is not None:
                on_cycle(done[-1])
        done.append(chaos.final())
    finally:
        chaos.log.close()
    log_text = (work / "service.log").read_text(errors="replace")
    outcomes: dict[str, int] = {}
    for c in done:
        for k, v in c.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + v
    bad = [f for c in done for f in failures(c)]
    report = {
        "cycles": cycles, "seed": seed, "clients": list(clients), "seconds": round(time.monotonic() - t0, 1),
        "actions": {a: sum(c.action == a for c in done[:-1]) for a in ACTIONS},
        "during_start_up": sum(c.during_start_up for c in done),
        "recoveries": {r: sum(c.recovery.startswith(r) for c in done) for r in ("own stop", "power restore",
                                                                              "next start")},
        "requests": sum(v for k, v in outcomes.items() if k != "refused"),
        "outcomes": outcomes,
        "kills_leaving_changes": sum(c.journaled_at_kill > 0 for c in done),
        "files_left_changed_by_kills": sum(c.journaled_at_kill for c in done),
        "leaked_settings": sum(len(c.leaked) for c in done),
        "cycles_with_leaks": sum(bool(c.leaked) for c in done),
        "other_files_changed": sum(len(c.other_changed) for c in done),
        "temp_files_left": sum(len(c.temps_left) for c in done),
        "hung": outcomes.get("hung", 0), "cut": outcomes.get("cut", 0), "cut_at_kill": outcomes.get("cut_at_kill", 0),
        "bad_exits": sum(not exit_ok(c) for c in done),
        "sigterm_before_first_line": sum(c.before_first_line for c in done),
        "health_failures": sum(c.health_ok is False for c in done),
        "tracebacks_in_log": log_text.count("Traceback"),
        "failures": bad[:40], "failure_count": len(bad),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, load average "
                   f"{os.getloadavg()[0]:.1f}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "work": str(work) if not own else None,
    }
    if own and not bad:
        shutil.rmtree(work, ignore_errors=True)
    elif own:
        report["work"] = str(work)  # kept for the service log and the tree
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "stdlib-llama-8l")
    ap.add_argument("--clients", default="4-8", help="streaming clients per cycle, MIN-MAX")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no line per cycle on stderr")
    a = ap.parse_args()
    lo, _, hi = a.clients.partition("-")
    clients = (int(lo), int(hi or lo))

    def show(c: Cycle) -> None:
        if not a.quiet:
            print(f"cycle {c.n:3d} {c.action:24s} {'start-up' if c.during_start_up else 'serving ':8s} "
                  f"at {c.signal_at_s:5.2f} s exit {c.exit_code} {c.recovery:14s} {c.outcomes} "
                  f"{'; '.join(failures(c)) or 'ok'}", file=sys.stderr, flush=True)

    report = run_chaos(a.model, a.cycles, clients, a.seed, on_cycle=show)
    report["command"] = "python scripts/chaos_test.py " + " ".join(sys.argv[1:])
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    sys.exit(0 if report["failure_count"] == 0 else 1)


if __name__ == "__main__":
    main()
