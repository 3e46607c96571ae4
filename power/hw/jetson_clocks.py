"""jetson_clocks: pin every clock at its current-mode maximum, show the clocks, and undo it.

ORIN.md ("jetson_clocks"): it pins each clock at its mode maximum; ``--show`` prints the clocks and
``--store FILE`` / ``--restore FILE`` save and put back ``path:value`` lines.

Root ``/``: the real tool with a timeout. Before running it, the agent's own clock/fan files are
recorded in the journal, so ``restore`` undoes it like any other change (what jetson_clocks does to
cpuidle states is not journaled: use ``jetson_clocks --restore`` for those). Any other root (the twin):
the same effect is written to the tree's files through the journal, and ``--show`` is rebuilt from the
tree in the same dataclass the parser returns.
"""
from __future__ import annotations

import os

from power.hw import sysfs
from power.hw.cpu import CpuFreq
from power.hw.emc import Emc
from power.hw.fan import PWM_MAX, Fan
from power.hw.gpu import GpuClock
from power.hw.parsers import ClockShow, CpuShow, JetsonClocksShow, parse_jetson_clocks_show
from power.hw.tools import Runner, run_tool
from power.hw.writer import ClockWriter


class JetsonClocks:
    def __init__(self, root: str | os.PathLike[str], gpu: GpuClock, emc: Emc, cpu: CpuFreq, fan: Fan,
                 mode_name: str | None = None, runner: Runner = run_tool) -> None:
        self.root, self.gpu, self.emc, self.cpu, self.fan = root, gpu, emc, cpu, fan
        self.mode_name, self.runner = mode_name, runner

    def show(self) -> JetsonClocksShow:
        if sysfs.root_is_host(self.root):
            return parse_jetson_clocks_show(self.runner(["jetson_clocks", "--show"], 15.0))
        cpus = []
        for cl in self.cpu.read():
            for c in cl.cpus:
                cpus.append(CpuShow(c, c in cl.online, cl.governor or "", cl.min_khz or 0, cl.max_khz or 0,
                                    cl.cur_khz or 0))
        g = self.gpu.read() if self.gpu.available else None
        e = self.emc.read() if self.emc.available else None
        f = self.fan.read() if self.fan.available else None
        return JetsonClocksShow(
            "tegra234", None, None, tuple(cpus),
            ClockShow(g.min_hz or 0, g.max_hz or 0, g.cur_hz or 0) if g else None, None,
            ClockShow(e.min_hz or 0, e.max_hz or 0, e.cur_hz or 0) if e else None,
            e.locked if e else None, {}, {"pwm1": f.pwm} if f and f.pwm is not None else {}, self.mode_name)

    def is_active(self) -> bool:
        """Clocks pinned: GPU min == max and every online cluster's min == max."""
        g = self.gpu.read() if self.gpu.available else None
        if g is None or g.min_hz is None or g.min_hz != g.max_hz:
            return False
        return all(c.min_khz == c.max_khz for c in self.cpu.read() if c.online)

    def apply(self, writer: ClockWriter, *, fan: bool = False) -> None:
        """Pin the clocks at their maxima (and the fan at full with ``fan``), journaled."""
        if sysfs.root_is_host(self.root):
            # Record what we can put back ourselves before the tool changes it.
            assert writer.journal is not None or writer.dry_run
            for path in self._own_files():
                if writer.journal is not None and writer.is_allowed(path):
                    writer.journal.record(sysfs.to_board(self.root, sysfs.resolve(self.root, path)),
                                          writer.read_raw(path))
            if writer.dry_run:
                if writer.echo:
                    writer.echo("would run `jetson_clocks" + (" --fan`" if fan else "`"))
                return
            self.runner(["jetson_clocks", "--fan"] if fan else ["jetson_clocks"], 30.0)
            return
        with writer.transaction():
            for cl in self.cpu.read():
                if cl.online and cl.max_khz:
                    self.cpu.set_range(writer, cl.name, cl.max_khz, cl.max_khz)
            if self.gpu.available:
                top = self.gpu.read().max_hz
                if top:
                    self.gpu.set_range(writer, top, top)
            if self.emc.available and self.emc.info.locked:
                e = self.emc.read()
                top = e.max_hz
                if e.cap_hz and top and 0 < e.cap_hz < top:
                    top = e.cap_hz  # jetson_clocks respects the nvpmodel EMC cap
                if top:
                    self.emc.lock(writer, top)
            if fan and self.fan.available:
                self.fan.set_pwm(writer, PWM_MAX)

    def _own_files(self) -> list[str]:
        return [*self.cpu.writable(), *self.gpu.writable(), *self.emc.writable(), *self.fan.writable()]
