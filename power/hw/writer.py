"""Ordered, verified, all-or-nothing writes to the board's clock and fan files.

Owns the write half of ARCHITECTURE.md's "Changing the board is a transaction":
- only paths discovery identified as clock/fan files may be written (anything else is refused
  before a byte is read or recorded);
- the journal records a file's original content before its first write;
- min/max pairs are written in the order the kernel accepts (ORIN.md, "write order": raising, max
  then min; lowering, min then max) and the EMC is locked before its rate is set;
- every write is read back; a refused or mismatching write raises an error naming the file and rolls
  back what the same transaction already changed, so nothing is left half-applied;
- writes that change nothing are skipped (tuned does the same);
- a dry run prints what it would write and touches nothing.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.errors import BoardWriteError, RefusedWrite
from power.hw.journal import BoardIO, Journal, describe_os_error


@dataclass(frozen=True)
class PlannedWrite:
    path: str
    old: str
    new: str


def _same(a: bytes, b: bytes) -> bool:
    sa, sb = a.decode(errors="replace").strip(), b.decode(errors="replace").strip()
    if sa == sb:
        return True
    try:
        return int(sa) == int(sb)
    except ValueError:
        return False


def _int(text: str) -> int | None:
    try:
        return int(text.split()[0]) if text else None
    except ValueError:
        return None


class ClockWriter:
    """Writes to the allowed board files of one root, through a journal (or as a dry run)."""

    def __init__(self, root: str | os.PathLike[str], allowed: Mapping[str, str], journal: Journal | None, *,
                 io: BoardIO | None = None, dry_run: bool = False,
                 echo: Callable[[str], None] | None = None) -> None:
        if journal is None and not dry_run:
            raise ValueError("a ClockWriter needs a journal unless it is a dry run")
        self.root = os.path.normpath(os.path.abspath(os.fspath(root)))
        self.journal = journal
        self.io = io or (journal.io if journal is not None else BoardIO())
        self.dry_run = dry_run
        self.echo = echo
        # Compare resolved host paths, so a class link (/sys/class/devfreq/...) and the device path
        # it points at are the same file, and "../" tricks can never match.
        self._allowed = {sysfs.resolve(self.root, p): desc for p, desc in allowed.items()}
        self.planned: list[PlannedWrite] = []
        self._shadow: dict[str, bytes] = {}  # dry run: what we would have written
        self._undo: list[tuple[str, bytes | None]] | None = None
        # Resolved host paths by board path: sysfs links name device topology, which does not change
        # while the writer lives; resolving walks every component (~90 us), too slow per phase switch.
        self._hosts: dict[str, str] = {}
        self.clamps: list[str] = []     # read-backs the kernel clamped (accepted writes)
        self._boards: dict[str, str] = {}

    def for_tool(self, allowed: Mapping[str, str]) -> "ClockWriter":
        """A writer for a tool's own files (the twin's nvpmodel / jetson_clocks write caps, core online
        state and nvpmodel's status file, which the agent never writes): its own allow-list, the same
        journal, I/O, dry-run state and echo, so a restore undoes the tool's writes too."""
        w = ClockWriter(self.root, allowed, self.journal, io=self.io, dry_run=self.dry_run, echo=self.echo)
        w.planned, w._shadow = self.planned, self._shadow     # a dry run sees its own earlier writes
        return w

    def _host(self, path: str) -> str:
        host = self._hosts.get(path)
        if host is None:
            host = self._hosts[path] = sysfs.resolve(self.root, path)
        return host

    # -- reading -------------------------------------------------------------------------------

    def is_allowed(self, path: str) -> bool:
        return self._host(path) in self._allowed

    def read_raw(self, path: str) -> bytes:
        host = self._host(path)
        if host in self._shadow:
            return self._shadow[host]
        try:
            return self.io.read(host)
        except OSError as exc:
            raise BoardWriteError(describe_os_error(exc, "read", path)) from exc

    def read_int(self, path: str) -> int:
        raw = self.read_raw(path)
        try:
            return int(raw.split()[0])
        except (ValueError, IndexError) as exc:
            raise BoardWriteError(f"cannot read a number from {path}: {raw[:40]!r}") from exc

    # -- transactions --------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator["ClockWriter"]:
        """Group writes: if any raises, the ones already made are undone, newest first.

        Only ``Exception`` triggers the rollback; a process that dies (or a ``BaseException`` the
        tests raise to play a crash) leaves the journal, which the next start restores.
        """
        if self._undo is not None:  # nested: join the outer transaction
            yield self
            return
        self._undo = []
        try:
            yield self
        except Exception as exc:
            undo, self._undo = self._undo, None
            failures = self._rollback(undo)
            if failures:
                raise BoardWriteError(f"{exc}\nrollback also failed (run `orin-agent power restore`):\n  "
                                      + "\n  ".join(failures)) from exc
            raise
        except BaseException:
            self._undo = None
            raise
        else:
            self._undo = None

    def _rollback(self, undo: list[tuple[str, bytes | None]]) -> list[str]:
        failures = []
        for host, old in reversed(undo):
            try:
                if old is None:
                    self.io.remove(host)
                else:
                    self.io.write(host, old)
            except OSError as exc:
                failures.append(describe_os_error(exc, "roll back", sysfs.to_board(self.root, host)))
        return failures

    # -- writing -------------------------------------------------------------------------------

    def write(self, path: str, value: int | str, *, group: str | None = None, role: str | None = None,
              create: bool = False, accept: tuple[int, int] | None = None) -> bool:
        """Write one value (``"612000000"``), verified. Returns False if it was already in force.

        ``create`` lets a missing file be made (only for state files such as nvpmodel's status; the
        journal then records it as absent, so a restore removes it again). ``accept``: a read-back
        in this range is a kernel clamp, recorded in ``clamps`` instead of raised."""
        with self.transaction():
            return self._write(path, value, group, role, create, accept)

    def _write(self, path: str, value: int | str, group: str | None, role: str | None,
               create: bool = False, accept: tuple[int, int] | None = None) -> bool:
        host = self._host(path)
        if host not in self._allowed:
            raise RefusedWrite(f"refusing to write {path}: discovery under {self.root} did not identify it "
                               f"as a clock or fan file")
        board = self._boards.get(host)
        if board is None:
            board = self._boards[host] = sysfs.to_board(self.root, host)
        new = f"{value}\n".encode()
        old: bytes | None
        if create and host not in self._shadow and not os.path.lexists(host):
            old = None
        else:
            old = self.read_raw(path)
            if _same(old, new):
                return False
        shown = "absent" if old is None else old.decode(errors="replace").strip()
        if self.dry_run:
            self.planned.append(PlannedWrite(board, shown, str(value)))
            self._shadow[host] = new
            if self.echo:
                self.echo(f"would write {value} to {board} (now {shown})")
            return True
        assert self.journal is not None and self._undo is not None
        self.journal.record(board, old, group, role)
        try:
            if old is None:
                os.makedirs(os.path.dirname(host), exist_ok=True)
            self.io.write(host, new, create=old is None)
        except OSError as exc:
            raise BoardWriteError(describe_os_error(exc, "write", board, str(value))) from exc
        self._undo.append((host, old))
        try:
            back = self.io.read(host)
        except OSError as exc:
            raise BoardWriteError(describe_os_error(exc, "read back", board)) from exc
        if not _same(back, new):
            got = back.decode(errors="replace").strip()
            if accept is not None and _int(got) is not None and accept[0] <= int(got) <= accept[1]:
                # a kernel clamp (QoS/OPP limits on devfreq, BPMP rounding on EMC): the file holds
                # the effective value; report it, keep it (the journal still has the original)
                self.clamps.append(f"{board}: wrote {value}, the kernel holds {got}")
                return True
            raise BoardWriteError(f"wrote {value} to {board} but it reads back {got!r}")
        return True

    def write_range(self, min_path: str, max_path: str, new_min: int, new_max: int, *, group: str) -> None:
        """Set a min/max pair in the order the kernel accepts (ORIN.md, "write order").

        Writing max first is safe while the current minimum stays at or below the new maximum
        (raising); otherwise the minimum must come down first (lowering). Either way no
        intermediate state has min above max, so devfreq/cpufreq never see an invalid pair.
        """
        if new_min > new_max:
            raise ValueError(f"{group}: minimum {new_min} is above maximum {new_max}")
        with self.transaction():
            cur_min = self.read_int(min_path)
            # devfreq/cpufreq read back the effective value after QoS/OPP limits (ORIN.md field
            # notes): a maximum held lower, or a minimum held higher, inside the range is a clamp
            hi_ok, lo_ok = (new_min, new_max), (new_min, new_max)
            if cur_min <= new_max:
                self._write(max_path, new_max, group, "max", accept=hi_ok)
                self._write(min_path, new_min, group, "min", accept=lo_ok)
            else:
                self._write(min_path, new_min, group, "min", accept=lo_ok)
                self._write(max_path, new_max, group, "max", accept=hi_ok)
