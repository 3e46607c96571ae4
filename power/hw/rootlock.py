"""One controlling process per board root: an exclusive ``flock`` on a lock file named after the
resolved root (``<lock dir>/<sha256 of the root>.lock``, holding the holder's PID and the root).

The journal's own lock (power.hw.journal) covers one run directory; two processes with different run
directories on the same root would each journal the other's changes as "originals" and leave the
board changed. This lock covers the root itself. The kernel drops it when the holder dies, so a
kill -9 never leaves a stale lock. The default lock dir is ``<run dir's parent>/orin-agent/locks``:
``/run/orin-agent/locks`` for the default run dir ``/run/orin-agent``, shared by every run dir
beside it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from power.hw.errors import JournalError


class BoardBusy(JournalError):
    """Another live process holds the board root's lock; the message names its PID."""


def default_lock_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.fspath(run_dir))).parent / "orin-agent" / "locks"


def lock_path(root: str | os.PathLike[str], lock_dir: str | os.PathLike[str]) -> Path:
    resolved = os.path.realpath(os.fspath(root))
    return Path(lock_dir) / (hashlib.sha256(resolved.encode()).hexdigest()[:24] + ".lock")


class RootLock:
    """Held from construction until ``close()``; raises ``BoardBusy`` when another process holds it."""

    def __init__(self, root: str | os.PathLike[str], lock_dir: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.path = lock_path(root, lock_dir)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise JournalError(f"cannot create the board lock {self.path}: {exc.strerror}; set board.lock_dir "
                               "or --run-dir to a writable place") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split("\n", 1)[0].strip() or "?"
            os.close(fd)
            raise BoardBusy(f"board root {self.root} is already in use by another orin-agent (pid {holder}, "
                            f"lock {self.path}); stop it first, or give this one another --root") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{self.root}\n".encode(), 0)
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
