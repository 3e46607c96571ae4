"""Power modes (nvpmodel): the board's mode table, the mode in force, and switching modes.

ORIN.md ("power mode"): modes come from ``/etc/nvpmodel.conf`` (IDs differ per board: always parse
it); ``nvpmodel -q`` prints the current one; ``nvpmodel -m N`` switches. nvpmodel itself remembers the
mode in ``/var/lib/nvpmodel/status`` as ``pmode:000N`` (what ``nvpmodel -q`` reports after a reboot).

The tool is always called through the board's runner (power.hw.tools): the real ``nvpmodel`` on the
board, power.twin.runner.TwinRunner on a twin tree (it writes the mode's caps into the tree's files
through the journal and records the mode in ``<root>/var/lib/nvpmodel/status``). When ``nvpmodel -q``
cannot answer, the mode is read from that status file, then nvpmodel.conf's default. With the real
tool (whose writes bypass the journal) a switch first journals the mode in force (role ``mode``), so
``power restore`` switches back with ``nvpmodel -m``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.cpu import CpuFreq
from power.hw.emc import Emc
from power.hw.gpu import GpuClock
from power.hw.parsers import (NvpModelConf, NvpModelConfError, format_nvpmodel_status, parse_nvpmodel_conf,
                              parse_nvpmodel_query, parse_nvpmodel_status)
from power.hw.tools import Runner, ToolError, journals_writes, run_tool
from power.hw.writer import ClockWriter

CONF = "/etc/nvpmodel.conf"
STATUS = "/var/lib/nvpmodel/status"


@dataclass(frozen=True)
class ModeReading:
    id: int | None
    name: str | None
    source: str  # "nvpmodel -q", "status file", "default in nvpmodel.conf"


@dataclass(frozen=True)
class ModeChange:
    mode: ModeReading
    applied: tuple[str, ...]  # "GPU MAX_FREQ 612000000"
    skipped: tuple[str, ...]  # settings with no writable file in this tree


class NvpModel:
    def __init__(self, root: str | os.PathLike[str], gpu: GpuClock, emc: Emc, cpu: CpuFreq,
                 runner: Runner = run_tool) -> None:
        self.root, self.gpu, self.emc, self.cpu, self.runner = root, gpu, emc, cpu, runner

    @property
    def available(self) -> bool:
        return sysfs.is_file(self.root, CONF)

    def conf(self) -> NvpModelConf:
        text = sysfs.read_text(self.root, CONF)
        if text is None:
            raise NvpModelConfError(f"{sysfs.board_path(self.root, CONF)} is missing: power modes unavailable")
        try:
            return parse_nvpmodel_conf(text)
        except NvpModelConfError as exc:
            raise NvpModelConfError(f"{sysfs.board_path(self.root, CONF)}: {exc}") from exc

    def current(self) -> ModeReading | None:
        conf = None
        try:
            conf = self.conf()
        except NvpModelConfError:
            conf = None

        def named(mode_id: int | None, source: str) -> ModeReading:
            name = None
            if conf is not None and mode_id is not None:
                name = next((m.name for m in conf.modes if m.id == mode_id), None)
            return ModeReading(mode_id, name, source)

        try:
            q = parse_nvpmodel_query(self.runner(["nvpmodel", "-q"], 10.0))
            return ModeReading(q.id, q.name, "nvpmodel -q")
        except (ToolError, ValueError):
            pass  # fall back to the file nvpmodel keeps
        status = sysfs.read_text(self.root, STATUS)
        if status and (mode_id := parse_nvpmodel_status(status)) is not None:
            return named(mode_id, "status file")
        if conf is not None and conf.default_id is not None:
            return named(conf.default_id, "default in nvpmodel.conf")
        return None

    def set_mode(self, mode: int | str, writer: ClockWriter) -> ModeChange:
        """Switch power mode (``2`` or ``MODE_30W``) with ``nvpmodel -m``. The runner's lines
        ``applied ...`` / ``skipped ...`` (the twin's) become the change's applied/skipped settings."""
        m = self.conf().mode(mode) if self.available else None
        mode_id = m.id if m else int(mode)
        if writer is not None and writer.journal is not None and not writer.dry_run \
                and not journals_writes(self.runner):
            # the real tool writes past the journal: record the mode in force (nvpmodel's status
            # line), so a restore runs `nvpmodel -m` back to it (power.hw.journal, role "mode")
            prev = self.current()
            if prev is not None and prev.id is not None:
                writer.journal.record(STATUS, (sysfs.read_text(self.root, STATUS) or
                                               format_nvpmodel_status(prev.id).strip()).encode() + b"\n",
                                      group="nvpmodel", role="mode")
        out = self.runner(["nvpmodel", "-m", str(mode_id)], 60.0, writer)
        lines = out.splitlines()
        applied = tuple(ln[len("applied "):] for ln in lines if ln.startswith("applied "))
        skipped = tuple(ln[len("skipped "):] for ln in lines if ln.startswith("skipped "))
        cur = None if writer is not None and writer.dry_run else self.current()
        return ModeChange(cur or ModeReading(mode_id, m.name if m else None, "nvpmodel -m"), applied, skipped)
