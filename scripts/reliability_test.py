"""Reliability run of the service as a hostile but fair client on loopback: `orin-agent serve --token`
on a fresh twin while idle and half-sent connections are held open, streaming clients run, and faults
are injected (clients that leave mid-stream and mid-request, lone surrogates, 5000-digit integers,
~1 MB prompts, text/plain bodies, foreign Host headers, an over-the-limit burst), then SIGTERM with
requests in flight. Reports connections held, requests, faults injected, 5xx seen (goal 0; the
designed 503s of the final stop are counted apart) and settings leaked (goal 0: the twin's tree after
the stop against before, but for the files the twin's own model rewrites as readings).

    python scripts/reliability_test.py --json                    # 200 idle connections, 8 clients, 30 s
    python scripts/reliability_test.py --idle 500 --duration 120 --model DIR
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TOKEN = "reliability"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BAD_BODIES = [  # (content-type, body, extra headers): each must be a 4xx
    ("application/json", b'{"prompt":"\\ud800abc","max_tokens":2}', {}),
    ("application/json", b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}", {}),
    ("application/json", json.dumps({"prompt": "word " * 200_000, "max_tokens": 2}).encode(), {}),
    ("text/plain", b'{"prompt":"x","max_tokens":2}', {"Origin": "http://evil.example"}),
    ("application/json", b'{"prompt":"x","max_tokens":2}', {"Host": "evil.example"}),
    ("application/json", b'{"prompt":"x","max_tokens":2,"tools":[{"type":"function"}]}', {}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tally:
    def __init__(self) -> None:
        self.requests = 0
        self.faults = 0
        self.status: dict[int, int] = {}
        self.errors: list[str] = []
        self.reopened = 0
        self.busy_503 = 0  # the designed answer to overload: JSON 503 with Retry-After

    def saw(self, code: int) -> None:
        self.requests += 1
        self.status[code] = self.status.get(code, 0) + 1

    @property
    def five_xx(self) -> int:
        return sum(n for c, n in self.status.items() if c >= 500)


async def hold_idle(port: int, n: int, until: float, tally: Tally) -> int:
    """Keep n idle connections open (reopening those the server times out); returns the most held."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    most = 0
    while time.monotonic() < until:
        alive = []
        for r, w in conns:
            if r.at_eof() or w.is_closing():
                tally.reopened += 1
                w.close()
            else:
                alive.append((r, w))
        conns = alive
        while len(conns) < n:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            if len(conns) % 10 == 0:
                w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half-sent headers
            conns.append((r, w))
        most = max(most, len(conns))
        await asyncio.sleep(0.5)
    for _, w in conns:
        w.close()
    return most


async def streamer(url: str, until: float, tally: Tally, cut_after: int | None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as c:
        while time.monotonic() < until:
            body = {"prompt": "def parse(", "max_tokens": 32, "ignore_eos": True, "stream": True}
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    tally.saw(r.status_code)
                    n, done = 0, False
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        done |= line == "data: [DONE]"
                        if cut_after is not None and n >= cut_after:
                            tally.faults += 1
                            break
                    if r.status_code == 200 and cut_after is None and not done:
                        tally.errors.append("a stream ended without [DONE]")
            except httpx.HTTPError as exc:
                tally.errors.append(f"{type(exc).__name__}: {exc}")


async def faulty(url: str, until: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=AUTH) as c:
        i = 0
        while time.monotonic() < until:
            ctype, raw, extra = BAD_BODIES[i % len(BAD_BODIES)]
            i += 1
            r = await c.post("/v1/completions", content=raw, headers={"content-type": ctype, **extra})
            tally.saw(r.status_code)
            tally.faults += 1
            if not 400 <= r.status_code < 500:
                tally.errors.append(f"bad body {raw[:40]!r} got {r.status_code}")
            try:  # a non-streaming client that leaves after 0.3 s
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 64, "ignore_eos": True},
                             timeout=httpx.Timeout(30, read=0.3))
            except httpx.ReadTimeout:
                tally.faults += 1
            r = await c.get("/health")
            tally.saw(r.status_code)


async def burst(url: str, n: int, tally: Tally) -> None:
    """More requests at once than the request limit: 429/503 JSON with Retry-After, never a plain 5xx."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
                                    for _ in range(n)), return_exceptions=True)
    for r in rs:
        if isinstance(r, httpx.Response):
            tally.faults += 1
            if r.status_code == 503 and r.headers.get("retry-after") and r.headers["content-type"].startswith(
                    "application/json"):
                tally.requests += 1
                tally.busy_503 += 1
            else:
                tally.saw(r.status_code)


async def final_stop(url: str, server: subprocess.Popen, n: int) -> dict[str, int]:
    """SIGTERM with n streams and n plain requests in flight: each must end with [DONE] / a JSON answer."""
    out = {"streams_done": 0, "streams_cut_unclean": 0, "plain_ok_or_503": 0, "plain_other": 0}

    async def one_stream(c: httpx.AsyncClient) -> None:
        lines = []
        try:
            async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                  "ignore_eos": True, "stream": True}) as r:
                lines = [ln async for ln in r.aiter_lines() if ln]
        except httpx.HTTPError:
            pass
        out["streams_done" if lines and lines[-1] == "data: [DONE]" else "streams_cut_unclean"] += 1

    async def one_plain(c: httpx.AsyncClient) -> None:
        try:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True})
            good = r.status_code == 200 or (r.status_code == 503 and r.headers.get("retry-after"))
        except httpx.HTTPError:
            good = False
        out["plain_ok_or_503" if good else "plain_other"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as c:
        tasks = [asyncio.create_task(one_stream(c)) for _ in range(n)] + \
                [asyncio.create_task(one_plain(c)) for _ in range(n)]
        await asyncio.sleep(1.0)
        server.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "stdlib-llama-8l")
    ap.add_argument("--idle", type=int, default=200, help="idle / half-sent connections held open")
    ap.add_argument("--clients", type=int, default=8, help="streaming clients (a quarter leave mid-stream)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--grace", type=float, default=3.0, help="the service's shutdown grace (s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from power.twin import create_twin
    from power.twin.driver import reading_files, tree_bytes

    tmp = Path(tempfile.mkdtemp(prefix="orin-agent-reliability-"))
    root = tmp / "root"
    create_twin(root, "agx-orin-64gb", "r36")
    pristine, readings = tree_bytes(root), reading_files(tmp)
    port = free_port()
    cfg = tmp / "agent.toml"
    cfg.write_text(f"[model]\nmax_seq = 256\n[server]\nheader_timeout_s = 5\nmax_in_flight = {args.clients + 24}\n"
                   f"[limits]\nmax_queue = 16\nshutdown_grace_s = {args.grace}\n")
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--config", str(cfg), "--model", str(args.model),
           "--root", str(root), "--run-dir", str(tmp / "run"), "--port", str(port), "--token", TOKEN]
    log_path = tmp / "server.log"
    server = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    tally = Tally()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/ready", timeout=2, headers=AUTH).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        async def run() -> tuple[int, dict[str, int]]:
            until = time.monotonic() + args.duration
            cut = max(1, args.clients // 4)
            held = asyncio.create_task(hold_idle(port, args.idle, until, tally))
            await asyncio.gather(*(streamer(url, until, tally, 3 if i < cut else None) for i in range(args.clients)),
                                 faulty(url, until, tally), burst(url, args.clients + 64, tally))
            most = await held
            return most, await final_stop(url, server, 4)

        most, stop = asyncio.run(run())
        rc = server.wait(timeout=args.grace + 30)
    finally:
        if server.poll() is None:
            server.kill()
    after = tree_bytes(root)
    leaked = sorted(k for k in set(pristine) | set(after) if pristine.get(k) != after.get(k) and k not in readings)
    text = log_path.read_text()
    summary = {
        "command": " ".join([Path(sys.executable).name] + sys.argv), "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "connections_held": most,
        "connections_reopened_after_server_timeout": tally.reopened, "requests": tally.requests,
        "faults_injected": tally.faults, "status_counts": tally.status, "5xx_seen": tally.five_xx,
        "busy_503_json_with_retry_after": tally.busy_503,
        "final_stop": stop, "exit_code": rc, "settings_leaked": len(leaked), "leaked_samples": leaked[:5],
        "log_tracebacks": text.count("Traceback"), "client_errors": len(tally.errors),
        "client_error_samples": tally.errors[:3],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:>40}: {v}")
    clean = (tally.five_xx == 0 and not leaked and rc == 0 and not tally.errors and stop["streams_cut_unclean"] == 0
             and stop["plain_other"] == 0 and summary["log_tracebacks"] == 0)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
