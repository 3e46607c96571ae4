"""The twin's nvpmodel and jetson_clocks: a :class:`power.hw.tools.Runner` that has the tools' effect on
a twin tree's files, through the caller's journal (so ``restore`` undoes it), in one transaction.

The hardware classes call it exactly as they call the real tools on the board (power.runtime.board
picks it for any root that is not the machine's own ``/``):
- ``nvpmodel -m N``: the mode's settings from the tree's nvpmodel.conf, written the way nvpmodel
  writes them, and the mode recorded in ``<root>/var/lib/nvpmodel/status`` in nvpmodel's own format
  (``pmode:000N``; the twin model reads that file to know the mode). Prints one ``applied ...`` or
  ``skipped ...`` line per setting.
- ``jetson_clocks [--fan]``: every online cluster, the GPU and (when locked) the EMC pinned at their
  current maxima (the EMC at the nvpmodel cap), and the fan at full with ``--fan``.
- ``jetson_clocks --show``: the clocks in the tool's own text form.
- ``nvpmodel -q`` is not answered: the mode is read from the status file.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from power.hw import sysfs
from power.hw.backends import SysfsBoard
from power.hw.cpu import ClusterInfo
from power.hw.errors import ToolError
from power.hw.fan import PWM_MAX
from power.hw.nvpmodel import STATUS
from power.hw.parsers import (ClockShow, ConfMode, CpuShow, JetsonClocksShow, NvpModelConfError,
                              format_jetson_clocks_show, format_nvpmodel_status)
from power.hw.writer import ClockWriter


class TwinRunner:
    """``nvpmodel`` / ``jetson_clocks`` for the tree under ``root``."""

    journals_writes = True      # its writes go through the caller's journal (power.hw.tools)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = root

    def __call__(self, args: Sequence[str], timeout_s: float, writer: ClockWriter | None = None) -> str:
        cmd = list(args)
        if cmd == ["jetson_clocks", "--show"]:
            return format_jetson_clocks_show(_show(self._board()))
        if cmd[:1] == ["nvpmodel"] and cmd[1:2] == ["-q"]:
            raise ToolError(f"the twin under {self.root} keeps its mode in {STATUS}, not behind `nvpmodel -q`")
        if writer is None:
            raise ToolError(f"`{' '.join(cmd)}` on the twin needs a writer (it changes the tree)")
        board = self._board()
        tool = writer.for_tool(_tool_files(board))
        if len(cmd) == 3 and cmd[:2] == ["nvpmodel", "-m"]:
            applied, skipped = _set_mode(board, board.nvpmodel.conf().mode(int(cmd[2]) if cmd[2].isdigit() else cmd[2]), tool)
            return "".join(f"applied {a}\n" for a in applied) + "".join(f"skipped {s}\n" for s in skipped)
        if cmd in (["jetson_clocks"], ["jetson_clocks", "--fan"]):
            idle = _idle_state_files(self.root, board)
            tool = writer.for_tool({**_tool_files(board), **{f: "CPU idle state" for f in idle}})
            _pin(board, tool, fan=cmd[-1] == "--fan")
            with tool.transaction():
                # jetson_clocks also disables every online core's idle states (captured `jetson_clocks
                # --show`: `IdleStates: WFI=1 c7=1` before, `WFI=0 c7=0` after; ORIN.md)
                for f in idle:
                    tool.write(f, "1")
            return ""
        raise ToolError(f"`{' '.join(cmd)}`: the twin does not emulate this command")

    def _board(self) -> SysfsBoard:
        """The tree as it is now (a mode switch changes which cores and caps there are)."""
        return SysfsBoard(self.root, runner=self)


def _tool_files(board: SysfsBoard) -> dict[str, str]:
    """What the tools write: the agent's clock/fan files, and the caps, core online state, TPC gating
    and status file that only nvpmodel writes."""
    out = {**board.writable(), **board.emc.cap_writable(), **board.cpu.online_writable(),
           STATUS: "nvpmodel status (pmode:NNNN)"}
    if board.info.gpu.tpc_pg_mask:
        out[board.info.gpu.tpc_pg_mask] = "GPU TPC power-gating mask"
    if board.info.gpu.railgate:
        out[board.info.gpu.railgate] = "GPU rail-gating (jetson_clocks turns it off)"
    return out


def _set_mode(board: SysfsBoard, mode: ConfMode, writer: ClockWriter) -> tuple[list[str], list[str]]:
    """Apply a mode's settings the way nvpmodel would, as one transaction.

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
            if param.startswith("CPU_A78_") and (cl := _cluster_for(board, param)) is not None:
                table = cl.available_khz
                lo = mode.min_floor(param) or (table[0] if table else None)
                hi = mode.max_cap(param) or (table[-1] if table else None)
                if lo is None or hi is None:
                    skipped.append(label + " (no frequency table)")
                    continue
                board.cpu.set_range(writer, cl.name, lo, hi)
                applied.append(label)
            elif param == "GPU" and board.gpu.available and board.gpu.info.available_hz:
                table = board.gpu.info.available_hz
                board.gpu.set_range(writer, mode.min_floor(param) or table[0], mode.max_cap(param) or table[-1])
                applied.append(label)
            elif param == "EMC" and board.emc.info.caps:
                # "No cap" is written as 0, as nvpmodel writes it (2022 NVIDIA files, and the twin).
                for cap_path in board.emc.info.caps:
                    writer.write(cap_path, mode.max_cap(param) or 0, group="emc", role="cap")
                applied.append(label)
            elif param == "TPC_POWER_GATING" and board.gpu.info.tpc_pg_mask and \
                    writer.is_allowed(board.gpu.info.tpc_pg_mask):
                writer.write(board.gpu.info.tpc_pg_mask, mode.value(param, "TPC_PG_MASK") or "0",
                             group="gpu", role="tpc_pg_mask")
                applied.append(f"{param} {mode.value(param, 'TPC_PG_MASK')}")
            elif param != "CPU_ONLINE":
                skipped.append(param)
        writer.write(STATUS, _status_text(board.root, mode.id), group="nvpmodel", role="status", create=True)
    return applied, skipped


def _status_text(root: str, mode_id: int) -> str:
    """``pmode:000N``, keeping what else nvpmodel keeps on the line (``fmode:cool``)."""
    old = sysfs.read_text(root, STATUS) or ""
    new = format_nvpmodel_status(mode_id).strip()
    if re.search(r"pmode:\s*\d+", old):
        return re.sub(r"pmode:\s*\d+", new, old, count=1)
    return new


def _cluster_for(board: SysfsBoard, param: str) -> ClusterInfo | None:
    """``CPU_A78_1`` caps the cluster of the CPU its MAX_FREQ path names (cpu4 on AGX)."""
    try:
        pdef = board.nvpmodel.conf().params.get(param)
    except NvpModelConfError:
        return None
    for path in (pdef.paths("MAX_FREQ") if pdef else ()):
        if m := re.search(r"/cpu(\d+)/cpufreq/", path):
            try:
                return board.cpu.cluster(int(m.group(1)))
            except ValueError:
                return None
    return None


def _pin(board: SysfsBoard, writer: ClockWriter, *, fan: bool) -> None:
    """jetson_clocks: every clock at its current maximum, the fan at full with ``fan``."""
    with writer.transaction():
        for cl in board.cpu.read():
            if cl.online and cl.max_khz:
                board.cpu.set_range(writer, cl.name, cl.max_khz, cl.max_khz)
        if board.gpu.available:
            top = board.gpu.read().max_hz
            if top:
                board.gpu.set_range(writer, top, top)
            if board.info.gpu.railgate:     # NVIDIA's jetson_clocks: `echo 0 > ${GPU_RAIL_GATE}`
                writer.write(board.info.gpu.railgate, "0")
        if board.emc.available and board.emc.info.locked:
            e = board.emc.read()
            top = e.max_hz
            if e.cap_hz and top and 0 < e.cap_hz < top:
                top = e.cap_hz  # jetson_clocks respects the nvpmodel EMC cap
            if top:
                board.emc.lock(writer, top)
        if fan and board.fan.available:
            board.fan.set_pwm(writer, PWM_MAX)


def _idle_state_files(root: str | os.PathLike[str], board: SysfsBoard) -> list[str]:
    """The ``cpuidle/stateN/disable`` files of the online cores that the tree has."""
    out = []
    for cl in board.cpu.read():
        for c in cl.online:
            for state in ("state0", "state1"):
                rel = f"sys/devices/system/cpu/cpu{c}/cpuidle/{state}/disable"   # the same on every L4T
                if (Path(root) / rel).is_file():
                    out.append("/" + rel)
    return out


def _show(board: SysfsBoard) -> JetsonClocksShow:
    """The clocks as ``jetson_clocks --show`` reports them."""
    cpus = []
    for cl in board.cpu.read():
        for c in cl.cpus:
            cpus.append(CpuShow(c, c in cl.online, cl.governor or "", cl.min_khz or 0, cl.max_khz or 0,
                                cl.cur_khz or 0))
    g = board.gpu.read() if board.gpu.available else None
    e = board.emc.read() if board.emc.available else None
    f = board.fan.read() if board.fan.available else None
    return JetsonClocksShow(
        "tegra234", None, None, tuple(cpus),
        ClockShow(g.min_hz or 0, g.max_hz or 0, g.cur_hz or 0) if g else None, None,
        ClockShow(e.min_hz or 0, e.max_hz or 0, e.cur_hz or 0) if e else None,
        e.locked if e else None, {}, {"pwm1": f.pwm} if f and f.pwm is not None else {}, None)
