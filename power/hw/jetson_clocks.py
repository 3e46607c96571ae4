"""jetson_clocks: pin every clock at its current-mode maximum, show the clocks, and undo it.

ORIN.md ("jetson_clocks"): it pins each clock at its mode maximum; ``--show`` prints the clocks and
``--store FILE`` / ``--restore FILE`` save and put back ``path:value`` lines.

The tool is always called through the board's runner (power.hw.tools): the real ``jetson_clocks`` on
the board, power.twin.runner.TwinRunner on a twin tree. The real tool writes outside our journal, so
before running it the agent's own clock/fan files are recorded in the journal and ``restore`` undoes
it like any other change; what it does to cpuidle states is covered by ``jetson_clocks --store`` into
the run directory first and ``--restore`` from there at restore time. The twin's runner writes
through the journal itself.
"""
from __future__ import annotations

import os

from power.hw import sysfs
from power.hw.cpu import CpuFreq
from power.hw.emc import Emc
from power.hw.fan import Fan
from power.hw.gpu import GpuClock
from power.hw.parsers import JetsonClocksShow, parse_jetson_clocks_show
from power.hw.tools import Runner, journals_writes, run_tool
from power.hw.writer import ClockWriter

STORE_NAME = "jetson_clocks.store"


class JetsonClocks:
    def __init__(self, root: str | os.PathLike[str], gpu: GpuClock, emc: Emc, cpu: CpuFreq, fan: Fan,
                 runner: Runner = run_tool) -> None:
        self.root, self.gpu, self.emc, self.cpu, self.fan = root, gpu, emc, cpu, fan
        self.runner = runner

    def show(self) -> JetsonClocksShow:
        return parse_jetson_clocks_show(self.runner(["jetson_clocks", "--show"], 15.0))

    def is_active(self) -> bool:
        """Clocks pinned: GPU min == max and every online cluster's min == max."""
        g = self.gpu.read() if self.gpu.available else None
        if g is None or g.min_hz is None or g.min_hz != g.max_hz:
            return False
        return all(c.min_khz == c.max_khz for c in self.cpu.read() if c.online)

    def apply(self, writer: ClockWriter, *, fan: bool = False) -> None:
        """Pin the clocks at their maxima (and the fan at full with ``fan``), journaled."""
        assert writer.journal is not None or writer.dry_run
        if not journals_writes(self.runner):
            # Record what we can put back ourselves before the tool changes it.
            for path in self.own_files():
                if writer.journal is not None and writer.is_allowed(path):
                    writer.journal.record(sysfs.to_board(self.root, sysfs.resolve(self.root, path)),
                                          writer.read_raw(path))
            if writer.journal is not None and not writer.dry_run:
                # the tool also disables CPU idle states (ORIN.md field notes), which the journal's
                # files do not cover: its own --store file, under the run directory, puts them back
                # (power.hw.journal runs `jetson_clocks --restore FILE` for this entry)
                store = os.path.abspath(os.fspath(writer.journal.run_dir / STORE_NAME))
                self.runner(["jetson_clocks", "--store", store], 30.0, writer)
                writer.journal.record(store, b"", group="jetson_clocks", role="store")
        self.runner(["jetson_clocks", "--fan"] if fan else ["jetson_clocks"], 30.0, writer)

    def own_files(self) -> list[str]:
        """The agent's clock/fan files the tool changes."""
        return [*self.cpu.writable(), *self.gpu.writable(), *self.emc.writable(), *self.fan.writable()]
