"""Stopping at any moment: SIGTERM from the command's first line (agent.boot) exits 0 with the board
untouched; requests accepted but not yet handled when SIGTERM comes get 503 with Retry-After, never a
closed socket (agent.api.server.DrainingServer); the temp files of a killed write are removed at the
next start; a full disk names the file and exits 75, which the unit's Restart= retries."""
from __future__ import annotations

import base64
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from power.hw.journal import JOURNAL_NAME, Journal
from power.twin import create_twin
from power.twin.driver import reading_files, tree_bytes

REPO = Path(__file__).resolve().parents[1]
GPU_MAX = "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/max_freq"
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: Path, root: Path, run: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "agent", "serve", "--model", str(model), "--root", str(root),
                             "--run-dir", str(run), "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, (proc.stderr.read() if proc.stderr else b"").decode()[-2000:]
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("the service did not get ready")


def _changed(before: dict[str, bytes], root: Path, scratch: Path) -> list[str]:
    skip = reading_files(scratch)
    now = tree_bytes(root)
    return sorted(k for k in set(before) | set(now)
                  if not k.startswith("run/") and k not in skip and before.get(k) != now.get(k))


# From 0.3 s: the interpreter's own start (site-packages, ~50-100 ms here) runs before any line of ours.
@pytest.mark.parametrize("delay_s", [0.3, 0.6, 1.2, 2.5])
def test_sigterm_during_start_up_exits_0_with_the_board_untouched(tiny_checkpoint: Path, tmp_path: Path,
                                                                   delay_s: float) -> None:
    root = tmp_path / "root"
    create_twin(root, "agx-orin-64gb", "r36")
    before = tree_bytes(root)
    proc = _serve(tiny_checkpoint, root, tmp_path / "run", _free_port())
    time.sleep(delay_s)  # while the interpreter imports the CLI and torch, or the board opens, or the model loads
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    assert rc == 0, (rc, (proc.stderr.read() if proc.stderr else b"").decode()[-2000:])
    assert not (tmp_path / "run" / JOURNAL_NAME).exists()
    assert _changed(before, root, tmp_path / "scratch") == []


def test_requests_accepted_but_not_handled_at_sigterm_get_503_with_retry_after(tiny_checkpoint: Path,
                                                                                tmp_path: Path) -> None:
    root = tmp_path / "root"
    create_twin(root, "agx-orin-64gb", "r36")
    port = _free_port()
    proc = _serve(tiny_checkpoint, root, tmp_path / "run", port)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]
        time.sleep(0.3)             # uvicorn has accepted these: open, no request yet
        proc.send_signal(signal.SIGSTOP)
        queued = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]  # the backlog
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.3)             # the stop is under way: uvicorn alone would have closed all 20 by now
        body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
        answers = []
        for s in idle + queued:
            try:
                s.sendall(REQUEST % (len(body), body))
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                answers.append(data.decode("latin-1"))
            except OSError as exc:  # a reset: the request met a closed socket
                answers.append(f"{type(exc).__name__}: {exc}")
            finally:
                s.close()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    heads = [a.split("\r\n", 1)[0] for a in answers]
    assert heads == ["HTTP/1.1 503 Service Unavailable"] * 20, heads
    assert all("retry-after: 5" in a.lower() for a in answers)
    assert rc == 0


def _plant_journal(run: Path, root: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    original = (root / GPU_MAX).read_bytes()
    doc = {"format": 1, "root": str(root), "pid": 12345, "entries": [
        {"path": "/" + GPU_MAX, "original_b64": base64.b64encode(original).decode(), "group": "gpu", "role": "max"}]}
    (run / JOURNAL_NAME).write_text(json.dumps(doc))


def test_the_temp_files_of_a_killed_write_are_removed_at_the_next_start(tmp_path: Path) -> None:
    root, run = tmp_path / "root", tmp_path / "run"
    create_twin(root, "agx-orin-64gb", "r36")
    _plant_journal(run, root)
    left = [run / ".journal.json.12345.tmp", run / ".power-state.json.tmp",
            root / (GPU_MAX + ".12345.140000.tmp")]  # BoardIO's replace of a twin file, killed before its rename
    for p in left:
        p.write_text("half")
    keep = [run / "notes.tmp", root / (GPU_MAX + ".bak")]  # not a temp file of ours
    for p in keep:
        p.write_text("x")
    j = Journal(run, root, recover=True)
    try:
        assert sorted(j.stale_temps) == sorted(map(str, left))
    finally:
        j.close()
    assert not any(p.exists() for p in left) and all(p.exists() for p in keep)
    assert not (run / JOURNAL_NAME).exists()


def test_a_full_disk_names_the_file_and_exits_75_which_the_unit_retries(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import app
    from power.hw import journal

    unit = (REPO / "systemd" / "orin-agent.service").read_text()
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2\n" in unit  # 75 is retried
    root = tmp_path / "root"
    create_twin(root, "agx-orin-64gb", "r36")

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(journal, "_atomic_write", full)
    out = CliRunner().invoke(app, ["power", "set", "max", "--root", str(root), "--run-dir", str(tmp_path / "run")])
    assert out.exit_code == 75, out.output
    assert f"{tmp_path / 'run' / JOURNAL_NAME}" in out.output and "no space left" in out.output
    assert "Traceback" not in out.output


def test_serve_on_a_really_full_disk_exits_75_naming_the_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): the monkeypatched test covers the mapping")
    try:
        (full / "run").mkdir()
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill it up
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        root = tmp_path / "root"
        create_twin(root, "agx-orin-64gb", "r36")
        r = subprocess.run([sys.executable, "-m", "agent", "serve", "--model", str(tiny_checkpoint), "--root",
                            str(root), "--run-dir", str(full / "run"), "--port", str(_free_port())], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 75, r.stdout + r.stderr
        assert str(full / "run") in r.stderr and "no space left" in r.stderr and "Traceback" not in r.stderr
    finally:
        subprocess.run(["umount", str(full)], check=False)
