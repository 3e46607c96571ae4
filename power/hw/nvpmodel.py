"""Power modes (nvpmodel): the board's mode table, the mode in force, and switching modes.

ORIN.md ("power mode"): modes come from ``/etc/nvpmodel.conf`` (IDs differ per board: always parse
it); ``nvpmodel -q`` prints the current one; ``nvpmodel -m N`` switches. nvpmodel itself remembers the
mode in ``/var/lib/nvpmodel/status`` as ``pmode:000N`` (what ``nvpmodel -q`` reports after a reboot).

Root ``/``: the real tool, with a timeout. Any other root (the twin): ``set_mode`` writes the mode's
caps from the tree's nvpmodel.conf into the tree's clock files through the journal, and records the
mode in ``<root>/var/lib/nvpmodel/status`` in nvpmodel's own format; the twin reads that file to know
the mode (that file and format are the contract with ``power.twin``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.cpu import ClusterInfo, CpuFreq
from power.hw.emc import Emc
from power.hw.gpu import GpuClock
from power.hw.parsers import (NvpModelConf, NvpModelConfError, ConfMode, format_nvpmodel_status,
                           parse_nvpmodel_conf, parse_nvpmodel_query, parse_nvpmodel_status)
from power.hw.tools import Runner, ToolError, run_tool
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

    def writable(self) -> dict[str, str]:
        """The state file nvpmodel keeps; only ever written when nvpmodel is emulated."""
        return {} if sysfs.root_is_host(self.root) else {STATUS: "nvpmodel status (pmode:NNNN)"}

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

        if sysfs.root_is_host(self.root):
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
        """Switch power mode (``2`` or ``MODE_30W``)."""
        if sysfs.root_is_host(self.root):
            m = self.conf().mode(mode) if self.available else None
            mode_id = m.id if m else int(mode)
            self.runner(["nvpmodel", "-m", str(mode_id)], 60.0)
            cur = self.current()
            return ModeChange(cur or ModeReading(mode_id, m.name if m else None, "nvpmodel -m"), (), ())
        return self._emulate(self.conf().mode(mode), writer)

    def _emulate(self, mode: ConfMode, writer: ClockWriter) -> ModeChange:
        """Apply a mode's settings to a twin tree the way nvpmodel would, as one transaction.

        Order: cores online first (an offline core's cpufreq files may vanish), then CPU, GPU and EMC
        caps, then the status file. -1 ("INT_MAX") and 0 become the top/bottom of the clock's own
        table, which is what the kernel clamps them to.
        """
        applied: list[str] = []
        skipped: list[str] = []
        with writer.transaction():
            for core in sorted({int(s.arg.split("_")[1]) for s in mode.settings
                                if s.param == "CPU_ONLINE" and re.fullmatch(r"CORE_\d+", s.arg)}):
                path = f"/sys/devices/system/cpu/cpu{core}/online"
                if core == 0 or not writer.is_allowed(path):
                    continue
                writer.write(path, int(mode.value("CPU_ONLINE", f"CORE_{core}") or 1), group=f"cpu{core}", role="online")
            for param in dict.fromkeys(s.param for s in mode.settings):
                label = f"{param} MIN/MAX_FREQ {mode.min_floor(param)}/{mode.max_cap(param)}"
                if param.startswith("CPU_A78_") and (cl := self._cluster_for(param)) is not None:
                    table = cl.available_khz
                    lo = mode.min_floor(param) or (table[0] if table else None)
                    hi = mode.max_cap(param) or (table[-1] if table else None)
                    if lo is None or hi is None:
                        skipped.append(label + " (no frequency table)")
                        continue
                    self.cpu.set_range(writer, cl.name, lo, hi)
                    applied.append(label)
                elif param == "GPU" and self.gpu.available and self.gpu.info.available_hz:
                    table = self.gpu.info.available_hz
                    self.gpu.set_range(writer, mode.min_floor(param) or table[0], mode.max_cap(param) or table[-1])
                    applied.append(label)
                elif param == "EMC" and self.emc.info.caps:
                    # "No cap" is written as 0, as nvpmodel writes it (2022 NVIDIA files, and the twin).
                    for cap_path in self.emc.info.caps:
                        writer.write(cap_path, mode.max_cap(param) or 0, group="emc", role="cap")
                    applied.append(label)
                elif param == "TPC_POWER_GATING" and self.gpu.info.tpc_pg_mask and \
                        writer.is_allowed(self.gpu.info.tpc_pg_mask):
                    writer.write(self.gpu.info.tpc_pg_mask, mode.value(param, "TPC_PG_MASK") or "0",
                                 group="gpu", role="tpc_pg_mask")
                    applied.append(f"{param} {mode.value(param, 'TPC_PG_MASK')}")
                elif param != "CPU_ONLINE":
                    skipped.append(param)
            writer.write(STATUS, self._status_text(mode.id), group="nvpmodel", role="status", create=True)
        return ModeChange(ModeReading(mode.id, mode.name, "status file"), tuple(applied), tuple(skipped))

    def _status_text(self, mode_id: int) -> str:
        """``pmode:000N``, keeping what else nvpmodel keeps on the line (``fmode:cool``)."""
        old = sysfs.read_text(self.root, STATUS) or ""
        new = format_nvpmodel_status(mode_id).strip()
        if re.search(r"pmode:\s*\d+", old):
            return re.sub(r"pmode:\s*\d+", new, old, count=1)
        return new

    def _cluster_for(self, param: str) -> ClusterInfo | None:
        """``CPU_A78_1`` caps the cluster of the CPU its MAX_FREQ path names (cpu4 on AGX)."""
        try:
            pdef = self.conf().params.get(param)
        except NvpModelConfError:
            return None
        for path in (pdef.paths("MAX_FREQ") if pdef else ()):
            if m := re.search(r"/cpu(\d+)/cpufreq/", path):
                try:
                    return self.cpu.cluster(int(m.group(1)))
                except ValueError:
                    return None
        return None
