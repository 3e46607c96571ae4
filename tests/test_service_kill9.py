"""Kill -9 of the real service in the middle of a decode, with its power controller holding the board:
the next start puts every board file the killed process changed back before it serves anything."""
from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service_helpers import make_twin, running_service

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_kill_9_mid_decode_then_restart_restores_the_board_first(tiny_checkpoint: Path, tmp_path: Path) -> None:
    root, run = make_twin(tmp_path / "root"), tmp_path / "run"
    journal = run / "journal.json"
    port = _free_port()
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--model", str(tiny_checkpoint), "--root", str(root),
           "--run-dir", str(run), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(ready, 120, "the service to be ready")
        body = {"prompt": "def parse(", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(5):  # a few tokens in: decoding, with the controller's clocks written
                next(lines)
            _wait(lambda: journal.exists() and json.loads(journal.read_text())["entries"], 10,
                  "the power controller's first journaled write")
            entries = json.loads(journal.read_text())["entries"]
            proc.kill()  # SIGKILL: no drain, no restore
            proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    originals = {e["path"]: None if e["original_b64"] is None else base64.b64decode(e["original_b64"])
                 for e in entries}
    changed = [p for p, b in originals.items() if (root / p.lstrip("/")).read_bytes() != b]
    assert changed, "the killed service should have left clock files changed"
    # The next start recovers the journal in setup_board, before the model loads and the twin and the
    # engine start (power_control=False: a new controller would write clocks again once serving).
    with running_service(tiny_checkpoint, tmp_path, twin=False, power_control=False):
        assert not journal.exists()
        for path in changed:
            host = root / path.lstrip("/")
            if originals[path] is None:
                assert not host.exists(), path
            elif not path.endswith("/emc/rate"):  # bpmp's rate follows the governor once unlocked
                assert host.read_bytes() == originals[path], path
