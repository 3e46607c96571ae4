"""The service's life against a twin: a crashed (kill -9) writer's board changes are restored before
the next start serves anything; SIGTERM drains, restores and exits 0 with sd_notify READY/STOPPING."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from service_helpers import make_twin, running_service

REPO = Path(__file__).resolve().parents[1]


def crash_after_write(root: Path, run_dir: Path, board_path: str, value: str) -> None:
    """A child process journals and changes one board file, then dies by SIGKILL mid-run."""
    code = textwrap.dedent(f"""
        import os, signal
        from power.hw.journal import Journal
        j = Journal({str(run_dir)!r}, {str(root)!r})
        host = os.path.join({str(root)!r}, {board_path.lstrip('/')!r})
        j.record({board_path!r}, open(host, 'rb').read())
        open(host, 'w').write({value!r})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO)
    assert p.returncode == -signal.SIGKILL


def test_start_restores_what_a_killed_run_left_changed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from power.twin.layout import twin_paths
    from power.physics.boards import board_for

    root = make_twin(tmp_path / "root")
    board_path = "/" + twin_paths(board_for("agx-orin-64gb", "r36"), "r36").gpu_devfreq + "/max_freq"
    host = root / board_path.lstrip("/")
    original = host.read_text()
    crash_after_write(root, tmp_path / "run", board_path, "306000000\n")
    assert host.read_text() == "306000000\n" and (tmp_path / "run" / "journal.json").exists()
    # twin=False: use the tree at tmp/root as it is (the service still finds and runs its twin model)
    # power_control=False: the controller would otherwise write the GPU clock again once serving
    with running_service(tiny_checkpoint, tmp_path, twin=False, power_control=False) as svc:
        assert host.read_text() == original
        assert not (tmp_path / "run" / "journal.json").exists()
        with httpx.Client(base_url=svc.url, timeout=30) as c:
            assert c.get("/ready").status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_restores_and_exits_zero(tiny_checkpoint: Path, tmp_path: Path) -> None:
    root = make_twin(tmp_path / "root")
    notify = tmp_path / "notify"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(notify))
    srv.settimeout(60)
    port = _free_port()
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "2000000"}
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--model", str(tiny_checkpoint), "--root", str(root),
           "--run-dir", str(tmp_path / "run"), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        msgs = []
        while not any(m.startswith(b"READY=1") for m in msgs):
            msgs.append(srv.recv(200))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/ready").status_code == 200
            body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [ln for ln in lines if ln]
            assert rest[-1] == "data: [DONE]"  # the in-flight request finished within the grace period
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "board restored" in out and "Traceback" not in out
        while True:
            m = srv.recv(200)
            msgs.append(m)
            if m.startswith(b"STOPPING=1"):
                break
        assert b"WATCHDOG=1" in msgs
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()


@pytest.mark.parametrize("delay_s", [0.0, 0.03])
def test_sigterm_right_after_the_first_board_write_still_restores(tiny_checkpoint: Path, tmp_path: Path,
                                                                  delay_s: float) -> None:
    """SIGTERM while the service is still starting, just after the power controller's first
    journaled write: exit 0 with every recorded file back, no journal left."""
    root = make_twin(tmp_path / "root")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--model", str(tiny_checkpoint), "--root", str(root),
           "--run-dir", str(run), "--port", str(_free_port())]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        doc = None
        while doc is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                doc = json.loads((run / "journal.json").read_text())
            except (FileNotFoundError, ValueError):
                time.sleep(0.003)
        assert doc is not None and doc["entries"], "the service never journaled a board write"
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert not (run / "journal.json").exists(), out[-2000:]
    import base64

    for e in doc["entries"]:
        if e["original_b64"] is not None:
            assert (root / e["path"].lstrip("/")).read_bytes() == base64.b64decode(e["original_b64"]), e["path"]
    assert "Traceback" not in out


def test_requests_queued_in_the_backlog_at_a_stop_get_503_not_a_reset(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A stop after the socket listens but before the server accepts anything (SIGTERM at the end of start-up):
    the requests already sent and waiting in the kernel's listen backlog are each answered 503 with Retry-After
    (agent.api.server.DrainingServer takes them in), none is reset, and the board is put back."""
    from agent.config import ServiceConfig
    from agent.phases import RecordingListener
    from agent.service import Service
    from power.twin.driver import reading_files, tree_bytes

    root = make_twin(tmp_path / "root")
    before = tree_bytes(root)
    cfg = ServiceConfig(model_dir=tiny_checkpoint, host="127.0.0.1", port=0, root=str(root),
                        run_dir=str(tmp_path / "run"), max_batch=4, max_queue=8, max_seq=256, default_max_tokens=16,
                        max_output_tokens=64, shutdown_grace_s=2.0)
    cfg.validate()
    svc = Service(cfg, listener=RecordingListener())
    svc.load()
    body = b'{"prompt": "a", "max_tokens": 2}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    clients = [socket.create_connection(("127.0.0.1", svc.port), timeout=30) for _ in range(4)]
    for c in clients:
        c.sendall(request)
    svc._on_signal(signal.SIGTERM, None)  # what the handler does: the stop lands before serving began
    assert svc.serve_forever() == 0
    for c in clients:
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = c.recv(65536)
            assert chunk, f"connection closed without an answer after {reply!r}"
            reply += chunk
        head = reply.split(b"\r\n\r\n")[0].decode().lower()
        assert head.startswith("http/1.1 503"), head
        assert "retry-after:" in head, head
        c.close()
    skip = reading_files(root)
    assert [k for k, v in before.items() if k not in skip and not k.startswith("run/")
            and tree_bytes(root).get(k) != v] == []
