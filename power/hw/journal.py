"""The restore journal: every board file's original content, kept on disk until it is put back.

Owns the rule from ARCHITECTURE.md ("Changing the board is a transaction"): before the first write to
a file its original bytes are recorded under the run directory (default ``/run/orin-agent``), with
an atomic replace and fsync, so that a crash at any point leaves a journal that the next process (or
``orin-agent power restore``) can use to put every file back, byte for byte, in reverse order.

One writer at a time: the run directory holds a ``flock``; the kernel drops it when the holder dies,
so "journal present and lock free" means the previous writer crashed (or detached on purpose).
Low-level file I/O goes through :class:`BoardIO` so tests can stand in for the kernel.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import glob
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from power.hw import sysfs
from power.hw.errors import BoardWriteError, JournalError, RefusedWrite, ToolError  # noqa: F401 (re-exported)
from power.hw.parsers import parse_nvpmodel_status
from power.hw.rootlock import BoardJoin, join_board

DEFAULT_RUN_DIR = "/run/orin-agent"
JOURNAL_NAME = "journal.json"
LOCK_NAME = "journal.lock"  # not "lock": a run dir of ROOT/run holds ROOT/run/lock/, the board lock's folder
_FORMAT = 1


_ERRNO_HINT = {
    errno.EACCES: "permission denied (run as root, or point --root at a tree you own)",
    errno.EPERM: "operation not permitted (run as root)",
    errno.EINVAL: "the kernel rejected the value (out of range, or min above max)",
    errno.EROFS: "read-only file system",
    errno.EISDIR: "it is a directory, not a file",
    errno.ENOENT: "no such file",
    errno.EBUSY: "device busy",
    errno.ENOSPC: "no space left on the device (free some space there; the service retries: exit 75)",
    errno.EDQUOT: "disk quota exceeded (free some space there; the service retries: exit 75)",
}


def describe_os_error(exc: OSError, verb: str, path: str, value: str | None = None) -> str:
    what = f"{verb} {value!r} to {path}" if value is not None else f"{verb} {path}"
    hint = _ERRNO_HINT.get(exc.errno or 0, exc.strerror or str(exc))
    return f"cannot {what}: {hint} [errno {exc.errno}]"


KERNEL_TREES = ("/sys/", "/proc/", "/dev/")  # attributes written in place (a rename there is refused)


class BoardIO:
    """Raw reads and writes of host paths. Writes never create a file (a sysfs attribute that is
    missing stays missing). In the kernel's trees a write goes in place; anywhere else (a twin's
    plain files) it is an atomic replace (temp file + rename), so a reader never sees a file that
    has been truncated but not yet written."""

    def read(self, host_path: str) -> bytes:
        with open(host_path, "rb") as fh:
            return fh.read()

    def write(self, host_path: str, data: bytes, *, create: bool = False) -> None:
        if not os.path.abspath(host_path).startswith(KERNEL_TREES):
            self._replace(host_path, data, create)
            return
        flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0)
        fd = os.open(host_path, flags, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)

    def remove(self, host_path: str) -> None:
        os.unlink(host_path)

    def jetson_clocks_restore(self, store_file: str) -> None:
        """Put back what ``jetson_clocks`` changed (clocks and cpuidle states) from its --store file."""
        from power.hw.tools import run_tool  # the tools module sits beside the journal
        try:
            run_tool(["jetson_clocks", "--restore", store_file], 60.0)
        except ToolError as exc:        # reported like a failed file write
            raise OSError(errno.EIO, str(exc)) from exc

    def set_mode(self, mode_id: int) -> None:
        """Switch the power mode back (a journaled ``nvpmodel -m``, role ``mode``)."""
        from power.hw.tools import run_tool  # the tools module sits beside the journal
        try:
            run_tool(["nvpmodel", "-m", str(mode_id)], 60.0)
        except ToolError as exc:        # reported like a failed file write
            raise OSError(errno.EIO, str(exc)) from exc

    @staticmethod
    def _replace(host_path: str, data: bytes, create: bool) -> None:
        try:
            mode = os.stat(host_path).st_mode & 0o7777
        except FileNotFoundError:
            if not create:
                raise
            mode = 0o644
        else:
            os.close(os.open(host_path, os.O_WRONLY))  # what an in-place write would meet (EACCES, ...)
        tmp = f"{host_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            try:
                _write_all(fd, data)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, host_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass(frozen=True)
class JournalEntry:
    """One file's original content. ``group``/``role`` pair min/max files (``gpu``/``min``) and the
    EMC lock with its rate, so a restore can order them the way the kernel accepts."""

    path: str  # board path, links already resolved (``/sys/devices/.../max_freq``)
    original: bytes | None  # None: the file did not exist (only state files are ever created)
    group: str | None = None
    role: str | None = None


@dataclass(frozen=True)
class RestoreReport:
    restored: tuple[str, ...]
    failed: tuple[str, ...]  # messages naming the file

    @property
    def ok(self) -> bool:
        return not self.failed


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a kill leaves it: Journal() removes it next time
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _check_board_path(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path or "/../" in path + "/":
        raise JournalError(f"journal entry has a bad path {path!r}")
    return path


def read_journal(run_dir: str | os.PathLike[str]) -> tuple[str, tuple[JournalEntry, ...]] | None:
    """The (root, entries) recorded in ``run_dir``, or ``None`` if there is no journal."""
    path = Path(run_dir) / JOURNAL_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(describe_os_error(exc, "read", str(path))) from exc
    try:
        doc = json.loads(raw)
        if doc.get("format") != _FORMAT:
            raise JournalError(f"{path}: unknown journal format {doc.get('format')!r}")
        entries = tuple(JournalEntry(_check_board_path(e["path"]),
                                     None if e["original_b64"] is None else base64.b64decode(e["original_b64"]),
                                     e.get("group"), e.get("role")) for e in doc["entries"])
        return str(doc["root"]), entries
    except (ValueError, KeyError, TypeError) as exc:
        raise JournalError(f"{path} is not a readable journal ({exc}); inspect it, restore by hand, "
                           f"then delete it") from exc


def restore_entries(root: str, entries: tuple[JournalEntry, ...], io: BoardIO) -> RestoreReport:
    """Put each entry's original back, newest first; min/max pairs in the order the kernel accepts."""
    restored: list[str] = []
    failed: list[str] = []
    done: set[int] = set()
    by_group: dict[tuple[str, str], int] = {}
    for i, e in enumerate(entries):
        if e.group and e.role:
            by_group[(e.group, e.role)] = i

    def put(i: int) -> None:
        e = entries[i]
        done.add(i)
        if e.role == "store":       # jetson_clocks' own --store file, outside the root
            try:
                io.jetson_clocks_restore(e.path)
                restored.append(e.path)
            except OSError as exc:
                failed.append(describe_os_error(exc, "restore", e.path, "jetson_clocks --restore"))
            return
        host = sysfs.resolve(root, e.path)
        try:
            if e.role == "mode" and e.original is not None:
                # the mode in force before a real `nvpmodel -m`: switch back, then nvpmodel's status
                mode_id = parse_nvpmodel_status(e.original.decode(errors="replace"))
                if mode_id is not None:
                    io.set_mode(mode_id)
            if e.original is None:
                if os.path.lexists(host):
                    io.remove(host)
            elif io.read(host) != e.original:
                io.write(host, e.original)
            restored.append(e.path)
        except OSError as exc:
            shown = "(absent)" if e.original is None else e.original.decode(errors="replace").strip()
            failed.append(describe_os_error(exc, "restore", e.path, shown))

    def put_rate_then_lock(rate_i: int, lock_i: int) -> None:
        # The bpmp takes a rate only while mrq_rate_locked is 1 (ORIN.md "EMC"): lock if needed, put
        # the rate back, then the lock's own original.
        rate_e, lock_e = entries[rate_i], entries[lock_i]
        rate_host, lock_host = sysfs.resolve(root, rate_e.path), sysfs.resolve(root, lock_e.path)
        try:
            if rate_e.original is not None and io.read(rate_host).strip() != rate_e.original.strip():
                if io.read(lock_host).strip() != b"1":
                    io.write(lock_host, b"1\n")
        except OSError as exc:
            done.update((rate_i, lock_i))
            failed.append(describe_os_error(exc, "restore", rate_e.path))
            return
        put(rate_i)
        put(lock_i)

    for i in reversed(range(len(entries))):
        if i in done:
            continue
        e = entries[i]
        if e.group and e.role in ("rate", "lock"):
            other = by_group.get((e.group, "lock" if e.role == "rate" else "rate"))
            if other is not None and other not in done:
                put_rate_then_lock(i if e.role == "rate" else other, other if e.role == "rate" else i)
                continue
        partner = {"min": "max", "max": "min"}.get(e.role or "")
        j = by_group.get((e.group, partner)) if e.group and partner else None
        if j is None or j in done:
            put(i)
            continue
        lo, hi = (i, j) if e.role == "min" else (j, i)
        try:
            cur_min = int(io.read(sysfs.resolve(root, entries[lo].path)))
            want_max = int(entries[hi].original or b"")
        except (OSError, ValueError):
            put(i)
            put(j)
            continue
        # Same rule as a forward write (ORIN.md "write order"): if the current minimum is above the
        # maximum we are about to restore, lower the minimum first; otherwise the maximum goes first.
        for k in ((lo, hi) if cur_min > want_max else (hi, lo)):
            put(k)
    return RestoreReport(tuple(restored), tuple(failed))


class Journal:
    """The on-disk journal of one run directory, held with an exclusive lock while open.

    ``recover=True`` (the default, and what a starting service wants) restores a journal left by a
    previous process before anything else; ``recover=False`` keeps it and adds to it.
    """

    def __init__(self, run_dir: str | os.PathLike[str], root: str | os.PathLike[str], *,
                 recover: bool = True, io: BoardIO | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.root = os.path.normpath(os.path.abspath(os.fspath(root)))
        self.io = io or BoardIO()
        self._lock_fd: int | None = None
        # The board's one owner first (power.hw.rootlock): a second owner, whatever its run dir, is
        # refused here, before it reads a journal or an original.
        self._board: BoardJoin | None = join_board(self.root)
        try:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise JournalError(describe_os_error(exc, "create run dir", str(self.run_dir))
                                   + "; pass --run-dir DIR to use another place") from exc
            self._lock()
        except BaseException:
            self._board.close()
            raise
        try:
            self._entries: list[JournalEntry] = []
            self.stale_temps = list(_remove_temps(self.run_dir.glob(".*.tmp")))  # a killed atomic write's
            found = read_journal(self.run_dir)
            if found is not None:
                old_root, entries = found
                if os.path.normpath(old_root) != self.root:
                    raise JournalError(
                        f"the journal in {self.run_dir} belongs to root {old_root}, not {self.root}; run "
                        f"`orin-agent power restore --root {old_root} --run-dir {self.run_dir}` first")
                self._entries = list(entries)
                # BoardIO's replace of a plain file (a twin's) killed between its temp file and the rename
                for e in entries:
                    host = sysfs.resolve(self.root, e.path)
                    if not os.path.abspath(host).startswith(KERNEL_TREES):
                        pattern = glob.escape(os.path.basename(host)) + ".*.tmp"
                        self.stale_temps += _remove_temps(Path(host).parent.glob(pattern))
                if recover:
                    self.restore()
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        path = self.run_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise JournalError(describe_os_error(exc, "open lock", str(path))) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise JournalError(f"another process (pid {holder}) is changing the board through "
                               f"{self.run_dir}; stop it or use another --run-dir") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise JournalError(describe_os_error(exc, "write", str(path))) from exc
        self._lock_fd = fd

    @property
    def entries(self) -> tuple[JournalEntry, ...]:
        return tuple(self._entries)

    @property
    def is_open(self) -> bool:
        return self._lock_fd is not None

    def recorded(self, path: str) -> bool:
        return any(e.path == path for e in self._entries)

    def record(self, path: str, original: bytes | None, group: str | None = None, role: str | None = None) -> None:
        """Persist ``original`` for ``path`` unless the file is already recorded (first write wins)."""
        if not self.is_open:
            raise JournalError(f"the journal in {self.run_dir} is closed")
        if self.recorded(path):
            return
        self._entries.append(JournalEntry(_check_board_path(path), original, group, role))
        self._persist()

    def _persist(self) -> None:
        doc = {"format": _FORMAT, "root": self.root, "pid": os.getpid(),
               "entries": [{"path": e.path,
                            "original_b64": None if e.original is None else base64.b64encode(e.original).decode(),
                            "original_text": None if e.original is None else e.original.decode(errors="replace").strip(),
                            "group": e.group, "role": e.role} for e in self._entries]}
        try:
            _atomic_write(self.run_dir / JOURNAL_NAME, json.dumps(doc, indent=1).encode())
        except OSError as exc:
            raise JournalError(describe_os_error(exc, "write journal", str(self.run_dir / JOURNAL_NAME))) from exc

    def restore(self) -> RestoreReport:
        """Put every recorded file back (newest first). The journal is removed only if all succeed."""
        report = restore_entries(self.root, tuple(self._entries), self.io)
        if report.ok:
            self._entries = []
            try:
                (self.run_dir / JOURNAL_NAME).unlink(missing_ok=True)
            except OSError as exc:
                raise JournalError(describe_os_error(exc, "remove journal", str(self.run_dir / JOURNAL_NAME))) from exc
        else:
            remaining = {e.path for e in self._entries} - set(report.restored)
            self._entries = [e for e in self._entries if e.path in remaining]
            self._persist()
            raise JournalError("could not restore every file; the journal keeps the rest for "
                               "`orin-agent power restore`:\n  " + "\n  ".join(report.failed))
        return report

    def close(self) -> None:
        """Release the lock, leaving any journal on disk (what a crash leaves too)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._board is not None:
            self._board.close()
            self._board = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_temps(paths: Iterable[Path]) -> list[str]:
    """Remove the given temp files (each a killed writer's, never a live one's: the caller holds the
    locks); returns their paths."""
    gone = []
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            gone.append(str(p))
    return gone


def restore_run_dir(run_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
                    io: BoardIO | None = None) -> RestoreReport:
    """``orin-agent power restore``: take the lock, restore the journal if any, release. ``root=None``
    restores under the root the journal itself recorded (what ExecStopPost wants after a kill)."""
    if not (Path(run_dir) / JOURNAL_NAME).exists():
        return RestoreReport((), ())
    if root is None:
        found = read_journal(run_dir)
        if found is None:
            return RestoreReport((), ())
        root = found[0]
    journal = Journal(run_dir, root, recover=False, io=io)
    try:
        return journal.restore()
    finally:
        journal.close()
