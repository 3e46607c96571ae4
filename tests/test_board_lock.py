"""One board, one owner (power.hw.rootlock): the lock's place follows the board root alone, every
command that writes to the board takes it, and a second owner is refused, naming the holder's PID and
command, before it reads a journal or an original; the board is unchanged after every refusal."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from agent.cli import app
from power.hw.journal import JOURNAL_NAME, Journal
from power.hw.rootlock import BoardBusy, BoardLock, lock_path, process_command, read_holder
from power.twin import create_twin
from power.twin.driver import reading_files, tree_bytes

REPO = Path(__file__).resolve().parents[1]
GPU_MAX = "sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/max_freq"
HOLDER = ("import sys\nfrom power.hw.rootlock import BoardLock\n"
          "lock = BoardLock(sys.argv[1], sys.argv[2])\nprint('held', flush=True)\nsys.stdin.read()\n")


def _twin(tmp_path: Path) -> Path:
    root = tmp_path / "board"
    create_twin(root, "agx-orin-64gb", "r36")
    return root


@pytest.fixture
def held_elsewhere(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A twin whose board lock another process holds as `orin-agent serve` (until the test ends)."""
    root = _twin(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), "orin-agent serve"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield root, proc
    finally:
        proc.kill()
        proc.wait(10)


def _board_files(root: Path) -> dict[str, bytes]:
    """The tree outside run/ (the journals, states and the lock itself live there)."""
    return {k: v for k, v in tree_bytes(root).items() if not k.startswith("run/")}


def _planted_journal(run_dir: Path, root: Path) -> bytes:
    """A journal as a crashed run would leave it: GPU max_freq's "original" is 1 Hz (so a restore that
    ran would show in the tree)."""
    run_dir.mkdir(parents=True)
    doc = {"format": 1, "root": str(root), "pid": 1, "entries": [
        {"path": "/" + GPU_MAX, "original_b64": base64.b64encode(b"1\n").decode(), "original_text": "1",
         "group": "gpu", "role": "max"}]}
    data = json.dumps(doc).encode()
    (run_dir / JOURNAL_NAME).write_bytes(data)
    return data


def test_the_lock_sits_at_a_place_fixed_by_the_root(tmp_path: Path) -> None:
    assert lock_path("/") == Path("/run/lock/orin-agent/board.lock")
    root = _twin(tmp_path)
    link = tmp_path / "same-board"
    link.symlink_to(root)
    assert lock_path(root) == root / "run/lock/orin-agent/board.lock" == lock_path(link)
    assert process_command(["/usr/bin/orin-agent", "power", "set", "eco", "--token", "secret"]) == \
        "orin-agent power set eco"
    assert "secret" not in process_command(["orin-agent", "serve", "--token", "secret"])


def test_a_second_owner_is_refused_naming_pid_and_command_before_it_reads_a_journal(
        held_elsewhere: tuple[Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    root, holder = held_elsewhere
    before = _board_files(root)
    planted = _planted_journal(tmp_path / "elsewhere" / "run", root)
    with pytest.raises(BoardBusy, match=rf"pid {holder.pid} \(orin-agent serve\).*board.lock"):
        Journal(tmp_path / "elsewhere" / "run", root)  # its recovery would have "restored" max_freq to 1
    with pytest.raises(BoardBusy, match=rf"pid {holder.pid}"):
        BoardLock(root / ".." / root.name, "orin-agent bench run")  # another spelling, the same board
    assert (tmp_path / "elsewhere" / "run" / JOURNAL_NAME).read_bytes() == planted
    assert _board_files(root) == before
    assert read_holder(lock_path(root)).pid == holder.pid


def test_every_writing_command_is_refused_beside_the_owner_and_the_board_is_unchanged(
        held_elsewhere: tuple[Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    root, holder = held_elsewhere
    before = _board_files(root)
    _planted_journal(tmp_path / "q" / "run3", root)
    runner = CliRunner()
    for args in (["power", "set", "max", "--root", str(root), "--run-dir", str(tmp_path / "p" / "run")],
                 ["power", "restore", "--root", str(root), "--run-dir", str(tmp_path / "q" / "run3")],
                 ["twin", "run", str(root), "--duration", "0.2", "--quiet"]):
        out = runner.invoke(app, args)
        assert out.exit_code == 2, (args, out.output)
        assert f"pid {holder.pid} (orin-agent serve)" in out.output and "Traceback" not in out.output, out.output
    assert (tmp_path / "q" / "run3" / JOURNAL_NAME).exists()  # restore refused: the journal kept for later
    assert not (tmp_path / "p" / "run" / JOURNAL_NAME).exists()
    assert _board_files(root) == before


def test_smoke_beside_the_owner_writes_nothing_and_names_it(
        held_elsewhere: tuple[Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    from agent.config import ServiceConfig
    from agent.smoke import BOARD_CHECKS, SmokeOptions, run_smoke

    root, holder = held_elsewhere
    before = _board_files(root)
    rep = run_smoke(SmokeOptions(str(root), str(tmp_path / "smoke-run"), ServiceConfig(), profile_dir=None),
                    only=BOARD_CHECKS)
    st = {r.name: r.status for r in rep.results}
    assert rep.ok and st["clock-gpu"] == st["clock-emc"] == st["clock-cpu"] == st["unchanged"] == "skip", st
    assert f"pid {holder.pid} (orin-agent serve)" in rep.result("clock-gpu").detail
    assert _board_files(root) == before  # not even the twin's readings: the owner runs the model


def test_in_one_process_journals_join_the_command_and_a_second_command_is_refused(tmp_path: Path) -> None:
    root = _twin(tmp_path)
    with BoardLock(root, "orin-agent serve"):
        with pytest.raises(BoardBusy, match=rf"pid {os.getpid()} \(orin-agent serve\)"):
            BoardLock(root, "orin-agent power set max")
        j1, j2 = Journal(tmp_path / "a", root), Journal(tmp_path / "b", root)  # the command's own journals
        j1.close()
        j2.close()
        assert _other_process_can_lock(root) is False  # still the command's
    assert _other_process_can_lock(root) is True
    j = Journal(tmp_path / "a", root)  # no command holds it: the journal holds it for its lifetime
    assert _other_process_can_lock(root) is False
    j.close()
    assert _other_process_can_lock(root) is True


def _other_process_can_lock(root: Path) -> bool:
    code = ("import sys\nfrom power.hw.rootlock import BoardBusy, BoardLock\n"
            "try:\n    BoardLock(sys.argv[1], 'probe').close()\nexcept BoardBusy:\n    sys.exit(3)\n")
    rc = subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO, timeout=60).returncode
    assert rc in (0, 3)
    return rc == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_serves_and_power_set_beside_serve_are_refused_and_the_board_is_as_before(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The two-instance case of the issue: run dirs under different parents (once, both started and
    each journaled the other's settings as originals, leaving the board changed)."""
    root = _twin(tmp_path)
    before = tree_bytes(root)
    port = _free_port()
    serve = [sys.executable, "-m", "agent.cli", "serve", "--model", str(tiny_checkpoint), "--root", str(root)]
    first = subprocess.Popen(serve + ["--run-dir", str(tmp_path / "x" / "run1"), "--port", str(port)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert first.poll() is None and time.monotonic() < end, "the first serve did not come up"
            time.sleep(0.1)
        second = subprocess.run(serve + ["--run-dir", str(tmp_path / "y" / "z" / "run2"), "--port",
                                         str(_free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"pid {first.pid} (orin-agent serve)" in second.stdout + second.stderr
        set_ = subprocess.run([sys.executable, "-m", "agent.cli", "power", "set", "eco", "--root", str(root),
                               "--run-dir", str(tmp_path / "q" / "run3")], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert set_.returncode == 2 and f"pid {first.pid} (orin-agent serve)" in set_.stderr, set_.stderr
        assert not (tmp_path / "y" / "z" / "run2").exists() and not (tmp_path / "q" / "run3" / JOURNAL_NAME).exists()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200  # the owner serves on
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    skip = reading_files(tmp_path / "scratch")
    now = tree_bytes(root)
    changed = [k for k in set(before) | set(now) if not k.startswith("run/") and k not in skip
               and before.get(k) != now.get(k)]
    assert not changed, f"board files changed after the refusals and the owner's stop: {changed[:5]}"
