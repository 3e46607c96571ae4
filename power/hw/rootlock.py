"""One owner per board: an exclusive ``flock`` on ``<root>/run/lock/orin-agent/board.lock``, at a place
fixed by the board root alone (``/run/lock/orin-agent/board.lock`` on a board, inside the tree for a
twin), holding the holder's PID and command.

The journal's own lock (power.hw.journal) covers one run directory; two processes with different run
directories on the same board would each journal the other's changes as "originals" and leave the
board changed. So the lock follows the board, never a run directory or a setting: every command that
writes to the board (``serve``, ``power set``, ``power restore``, ``smoke``, ``bench run``, ``twin
run``) holds it, and every :class:`power.hw.journal.Journal` joins it before it reads a journal or
an original, so a second owner is refused before it reads anything. ``/run/lock`` is where lock files
go (FHS 3.0 "/var/lock: Lock files", which systemd's tmpfiles.d/legacy.conf links to /run/lock, a
tmpfs: a reboot clears it); the kernel drops a ``flock`` when its holder dies, so a kill -9 never
leaves a stale lock. The file is never removed (unlinking a lock file lets a second process lock a
new file of the same name while the first still holds the old one).

Within one process the hold is shared: a command takes it once (:class:`BoardLock`, exclusive: a
second ``BoardLock`` on the same board is refused, in this process too), and the journals it opens
join that hold (:func:`join_board`); a journal opened with no command holding the board takes the
hold itself for its lifetime.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from power.hw.errors import JournalError

LOCK_DIR = "run/lock/orin-agent"  # under the board root: /run/lock/orin-agent on a board
LOCK_NAME = "board.lock"


class BoardBusy(JournalError):
    """Another owner holds the board's lock; the message names its PID and command."""


@dataclass(frozen=True)
class Holder:
    """What a lock file says about its holder (``pid`` None: unreadable or not yet written)."""
    pid: int | None
    command: str

    def describe(self) -> str:
        return f"pid {self.pid if self.pid is not None else '?'} ({self.command or 'command unknown'})"


def lock_path(root: str | os.PathLike[str]) -> Path:
    """The board lock of ``root`` (links resolved, so two spellings of one tree share one lock)."""
    return Path(os.path.realpath(os.fspath(root))) / LOCK_DIR / LOCK_NAME


def process_command(argv: list[str] | None = None) -> str:
    """This process's command, as a refusal names it: the program and its leading words, never an
    option's value (``--token T`` stays out): ``orin-agent power set balanced``."""
    args = sys.argv if argv is None else argv
    if not args:
        return f"python pid {os.getpid()}"
    words = [os.path.basename(args[0]) or "python"]
    for a in args[1:4]:
        if a.startswith("-"):
            break
        words.append(a[:40])
    return " ".join(words)


def read_holder(path: str | os.PathLike[str]) -> Holder:
    """The PID and command in a lock file (``Holder(None, "")`` when it says nothing readable)."""
    try:
        text = Path(path).read_bytes()[:512].decode(errors="replace")
    except OSError:
        return Holder(None, "")
    lines = text.split("\n")
    pid = int(lines[0]) if lines and lines[0].strip().isdigit() else None
    return Holder(pid, lines[1].strip() if len(lines) > 1 else "")


class _Hold:
    """This process's flock on one board lock file and who in the process uses it."""

    def __init__(self, path: Path, fd: int, command: str, exclusive: bool) -> None:
        self.path, self.fd, self.command = path, fd, command
        self.owners = 1 if exclusive else 0   # BoardLock holders (at most one)
        self.joined = 0 if exclusive else 1   # journals (and other joiners)


_HOLDS: dict[str, _Hold] = {}   # lock path -> this process's hold (a process-wide fact: flock is per process)
_HOLDS_LOCK = threading.Lock()


def _busy(root: str, path: Path, holder: Holder) -> BoardBusy:
    return BoardBusy(f"the board {root} is in use by {holder.describe()}; lock {path}. Stop that command "
                     f"first (orin-agent power restore --root {root} afterwards if it was killed), then retry")


def _take(root: str, path: Path, command: str) -> int:
    """Open and flock ``path`` (exclusive, non-blocking), write our PID and command; raise BoardBusy."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JournalError(f"cannot create the board lock's folder {path.parent}: {exc.strerror} [errno {exc.errno}]; "
                           "run as root (on a board), or give a --root you own") from exc
    writable = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        try:
            fd = os.open(path, os.O_RDONLY)  # someone else's lock file: a read fd still takes the flock
            writable = False
        except OSError as exc:
            raise JournalError(f"cannot open the board lock {path}: {exc.strerror} [errno {exc.errno}]; run as "
                               "root (on a board), or give a --root you own") from exc
    except OSError as exc:
        raise JournalError(f"cannot create the board lock {path}: {exc.strerror} [errno {exc.errno}]"
                           + ("; the disk is full: free space there" if exc.errno == errno.ENOSPC else "")) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise JournalError(f"cannot lock the board lock {path}: {exc.strerror} [errno {exc.errno}]") from exc
        holder = read_holder(path)
        for _ in range(5):          # the holder may be between its flock and writing its PID
            if holder.pid is not None:
                break
            time.sleep(0.01)
            holder = read_holder(path)
        raise _busy(root, path, holder) from None
    if writable:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{command}\n{root}\n".encode(), 0)
        except OSError:
            pass    # a full disk: the lock holds anyway, a refusal just cannot name us
    return fd


def _acquire(root: str | os.PathLike[str], command: str | None, exclusive: bool) -> Path:
    resolved = os.path.realpath(os.fspath(root))
    path = lock_path(resolved)
    key = str(path)
    with _HOLDS_LOCK:
        hold = _HOLDS.get(key)
        if hold is not None:
            if exclusive:
                if hold.owners:
                    raise _busy(resolved, path, Holder(os.getpid(), hold.command))
                hold.owners = 1
                hold.command = command or hold.command
            else:
                hold.joined += 1
            return path
        cmd = command or process_command()
        _HOLDS[key] = _Hold(path, _take(resolved, path, cmd), cmd, exclusive)
    return path


def _release(path: Path, exclusive: bool) -> None:
    with _HOLDS_LOCK:
        hold = _HOLDS.get(str(path))
        if hold is None:
            return
        if exclusive:
            hold.owners = 0
        else:
            hold.joined = max(0, hold.joined - 1)
        if hold.owners == 0 and hold.joined == 0:
            del _HOLDS[str(path)]
            os.close(hold.fd)


def held_here(root: str | os.PathLike[str]) -> bool:
    """Whether this process holds the board lock of ``root``."""
    with _HOLDS_LOCK:
        return str(lock_path(root)) in _HOLDS


class BoardLock:
    """A command's hold on a board, from construction until ``close()``: refused with ``BoardBusy``
    (naming the holder's PID and command) when another process, or another command in this one,
    holds it. Journals opened meanwhile on the same board join it."""

    def __init__(self, root: str | os.PathLike[str], command: str | None = None) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.path: Path | None = _acquire(self.root, command, exclusive=True)

    def close(self) -> None:
        if self.path is not None:
            _release(self.path, exclusive=True)
            self.path = None

    def __enter__(self) -> "BoardLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BoardJoin:
    """A journal's share of the board lock: this process's hold if it has one, else a hold of its own
    (for this process's command) until ``close()``; refused with ``BoardBusy`` like a BoardLock."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path: Path | None = _acquire(root, None, exclusive=False)

    def close(self) -> None:
        if self.path is not None:
            _release(self.path, exclusive=False)
            self.path = None


def join_board(root: str | os.PathLike[str]) -> BoardJoin:
    return BoardJoin(root)
