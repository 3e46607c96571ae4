"""Load test of the service: N concurrent streaming clients for D seconds against a model on CPU.

Starts `orin-agent serve` as a subprocess on a free port (on a fresh twin, so energy is accounted),
computes each prompt's greedy text with a single-request run (agent.engine.core.EngineCore stepped
alone in this process: one request at batch 1, no thread, no HTTP), then runs the clients (asyncio + httpx) and checks
every stream against it: zero errors and zero lost or duplicated tokens (the streamed text and the
token count equal the single-request run). Reports p50/p95 TTFT, throughput and the server's RSS at
start and end.

    python scripts/load_test.py                      # 32 clients, 60 s, the shipped model
    python scripts/load_test.py --clients 8 --duration 20 --model DIR --json
    python scripts/load_test.py --make-standin /tmp/standin   # random weights in the shipped shape
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
    "def read_file(path):\n    with open(path) as f:", "for i in range(10):", "try:\n    import json\nexcept",
    "def main():\n    parser = argparse.ArgumentParser(", "    return self._data[key]\n\n    def",
    "if __name__ == '__main__':", "from collections import defaultdict\n\n", "def is_prime(n):",
    "with open('out.txt', 'w') as f:", "lambda x: x", "def __repr__(self):", "raise ValueError(",
    "async def fetch(url):",
]


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_standin(out: Path) -> Path:
    """A random-weight model in the shipped model's shape with its real tokenizer (for when the trained
    weights are not there yet): the same compute per token, meaningless text."""
    import shutil

    from partition.checkpoint import random_model, save_model
    from partition.tokenizer import Tokenizer
    from scripts.train_small_model import model_config

    shipped = REPO / "models" / "stdlib-llama-8l"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (shipped / name).is_file():
            shutil.copy(shipped / name, out / name)
    tok = Tokenizer.from_dir(out)
    eot = tok.tk.token_to_id("<|endoftext|>")
    save_model(random_model(model_config(tok.vocab_size, eot, 1024), seed=0), out)
    return out


def references(model: Path, max_seq: int, max_tokens: int) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy text and token count from a single-request run."""
    from agent.model_load import load_core
    from agent.engine.types import Delta, Finished, SamplingParams

    core = load_core(model, backend="torch", max_seq=max_seq)
    out = {}
    for p in PROMPTS:
        events = list(core.generate(core.tokenizer.encode(p), SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        done = events[-1]
        assert isinstance(done, Finished)
        out[p] = ("".join(e.text for e in events if isinstance(e, Delta)), done.usage.completion_tokens)
    return out


async def client(i: int, url: str, deadline: float, max_tokens: int, refs: dict[str, tuple[str, int]],
                 results: list[dict]) -> None:
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as c:
        while time.monotonic() < deadline:
            prompt = PROMPTS[(i + n * 7) % len(PROMPTS)]
            n += 1
            rec: dict = {"client": i, "prompt": prompt, "ok": False}
            t0 = time.monotonic()
            try:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                text, usage, first = "", {}, None
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                        results.append(rec)
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for ch in chunk.get("choices", []):
                            if ch.get("text"):
                                first = first or time.monotonic()
                                text += ch["text"]
                t1 = time.monotonic()
                ref_text, ref_n = refs[prompt]
                rec.update(ok=True, ttft_s=(first - t0) if first else None, duration_s=t1 - t0,
                           tokens=usage.get("completion_tokens", 0), joules=usage.get("energy_joules"),
                           match=text == ref_text and usage.get("completion_tokens") == ref_n)
                if not rec["match"]:
                    rec["got"], rec["want"] = text, ref_text
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            results.append(rec)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "stdlib-llama-8l")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16, help="the service's cache rows")
    ap.add_argument("--max-seq", type=int, default=256)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--make-standin", type=Path, default=None, metavar="DIR",
                    help="write a random-weight model in the shipped shape to DIR and use it")
    args = ap.parse_args()
    model = make_standin(args.make_standin) if args.make_standin else args.model
    if not (model / "config.json").is_file():
        print(f"error: {model} has no config.json (train the shipped model, or use --make-standin DIR)",
              file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    log(f"references: greedy single-request runs of {len(PROMPTS)} prompts ...")
    refs = references(model, args.max_seq, args.max_tokens)

    tmp = Path(tempfile.mkdtemp(prefix="orin-agent-load-"))
    port = free_port()
    from power.twin import create_twin

    create_twin(tmp / "root", "agx-orin-64gb", "r36")
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--model", str(model), "--root", str(tmp / "root"),
           "--run-dir", str(tmp / "run"), "--port", str(port), "--max-batch", str(args.max_batch),
           "--backend", args.backend]
    cfg = tmp / "agent.toml"
    cfg.write_text(f"[model]\nmax_seq = {args.max_seq}\n[limits]\nmax_queue = {max(64, args.clients)}\n"
                   f"max_output_tokens = {max(args.max_tokens, 64)}\ndefault_max_tokens = {args.max_tokens}\n")
    cmd += ["--config", str(cfg)]
    server = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                print((tmp / "server.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        rss0 = rss_kb(server.pid)
        log(f"server ready on {url} (pid {server.pid}, RSS {rss0} kB); {args.clients} clients for {args.duration:.0f} s")
        results: list[dict] = []
        t0 = time.monotonic()

        async def run_all() -> None:
            end = time.monotonic() + args.duration
            await asyncio.gather(*(client(i, url, end, args.max_tokens, refs, results)
                                   for i in range(args.clients)))

        asyncio.run(run_all())
        wall = time.monotonic() - t0
        rss1 = rss_kb(server.pid)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    ok = [r for r in results if r["ok"]]
    errors = [r for r in results if not r["ok"]]
    mism = [r for r in ok if not r["match"]]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tokens = sum(r["tokens"] for r in ok)
    joules = [r["joules"] for r in ok if r.get("joules") is not None]
    m = re.search(r"^orin_agent_step_seconds_count\{phase=\"decode\"\} (\S+)", metrics, re.M)
    summary = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "model": str(model), "clients": args.clients, "duration_s": round(wall, 1),
        "max_tokens": args.max_tokens, "max_batch": args.max_batch, "requests": len(results),
        "completed": len(ok), "errors": len(errors), "mismatches": len(mism),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "throughput_tok_s": round(tokens / wall, 1), "requests_per_s": round(len(ok) / wall, 2),
        "completion_tokens": tokens, "decode_steps": float(m.group(1)) if m else None,
        "joules_per_token_twin": round(sum(joules) / tokens, 4) if joules and tokens else None,
        "server_rss_start_mb": round(rss0 / 1024, 1) if rss0 else None,
        "server_rss_end_mb": round(rss1 / 1024, 1) if rss1 else None,
        "error_samples": [r.get("error") for r in errors[:3]],
        "mismatch_samples": [{k: r[k] for k in ("prompt", "got", "want")} for r in mism[:3]],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:>24}: {v}")
    return 0 if not errors and not mism and ok else 1


if __name__ == "__main__":
    sys.exit(main())
