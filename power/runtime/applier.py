"""Applying controller decisions to the board (the power loop, power.runtime.loop, decides them).

- :class:`ClockApplier` writes a :class:`power.policy.dvfs.Decision` through the board layer's journaled
  :class:`power.hw.writer.ClockWriter` (allowlisted paths, kernel write order, read-back, rollback of a
  half-applied transaction). It remembers what it last applied and skips domains whose clocks did
  not change, so a phase switch touches only the files that move (usually GPU min/max and the EMC
  rate). Any write error restores the whole journal before it propagates: clocks are never left
  changed on error.
- :func:`tables_from_board` reads the clock tables and the power mode's caps from a discovered board;
  :func:`read_zone_samples` the thermal zones as the thermal controller takes them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from power.hw import sysfs
from power.hw.backends import SysfsBoard
from power.hw.emc import rate_accept
from power.hw.errors import BoardWriteError
from power.hw.nvpmodel import ModeReading
from power.hw.parsers import NvpModelConf
from power.hw.tables import BoardTables
from power.hw.writer import ClockWriter
from power.policy.dvfs import Decision
from power.policy.thermal import ZoneSample

log = logging.getLogger("orin_agent.power")


def tables_from_board(board: SysfsBoard, fallback_emc_hz: tuple[int, ...] = ()) -> BoardTables:
    """GPU table from devfreq, CPU table from cpufreq, EMC from the spec's table (bpmp debugfs lists
    no rates; ``fallback_emc_hz``) or min/max_rate; caps from the power mode in nvpmodel.conf."""
    gpu = board.info.gpu.available_hz
    if not gpu:
        raise ValueError("no GPU frequency table (available_frequencies) under the root: cannot plan clocks")
    # the first cluster with a table (an offline cluster's policy may list none, or answer EBUSY)
    cpu = next((cl.available_khz for cl in board.info.cpu.clusters if cl.available_khz), ())
    if not cpu:
        raise ValueError("no CPU frequency table (scaling_available_frequencies) under the root")
    emc = tuple(sorted(fallback_emc_hz))
    if not emc:
        r = board.emc.read()
        emc = tuple(sorted({f for f in (r.min_hz, r.max_hz) if f}))
    if not emc:
        raise ValueError("no EMC rates known for this board (min_rate/max_rate missing)")
    caps: list[int | None] = [None, None, None]
    mode = board.read_mode()
    if mode is not None and mode.id is not None and board.nvpmodel.available:
        m = board.nvpmodel.conf().resolve(mode.id)
        if m is not None:
            caps = [m.max_cap("GPU"), m.max_cap("EMC"), m.max_cap("CPU_A78_0")]
    return BoardTables(tuple(gpu), emc, tuple(cpu), caps[0], caps[1], caps[2])


def read_zone_samples(board: SysfsBoard) -> tuple[ZoneSample, ...]:
    out = []
    for z in board.read_zones():
        trip = next((t.temp_c for t in z.trips if t.type == "passive" and t.temp_c is not None), None)
        out.append(ZoneSample(z.name, z.temp_c, trip))
    return tuple(out)


class ClockApplier:
    """Writes decisions through one journaled writer; skips what is already in force."""

    def __init__(self, board: SysfsBoard, writer: ClockWriter) -> None:
        self.board, self.writer = board, writer
        self.applied: tuple[int, int, int, int] | None = None
        self.fan_applied: int | None = None
        self.emc_locked = False
        self.writes = 0
        self.notes: list[str] = []      # what was skipped or clamped: one line each, for people
        self._after: tuple[bytes, ...] = ()     # the clock files right after our last apply
        self._cpu_min = {cl.name: r.min_khz or cl.available_khz[0]
                         for cl, r in zip(board.info.cpu.clusters, board.cpu.read()) if cl.available_khz}

    def note(self, line: str) -> None:
        """Say once what was skipped (a missing interface) or clamped. Front ends show ``notes`` (the
        service's controller logs each new one as a warning; ``power set`` prints one line)."""
        if line not in self.notes:
            self.notes.append(line)
            log.info("%s", line)

    def set_mode(self, key: str, *, allow_reboot: bool = False) -> bool:
        """Switch to the profile's power mode (``max``, ``default``, a name or an id, resolved from
        this board's nvpmodel.conf) if another is in force. Returns True if it switched. A board
        without nvpmodel.conf or without that mode keeps its mode, with a note; so does a switch that
        changes the GPU TPC power-gating mask (it needs a reboot) unless ``allow_reboot``."""
        nvp = self.board.nvpmodel
        if not nvp.available:
            self.note(f"power mode {key!r} skipped: no /etc/nvpmodel.conf under {self.board.root} "
                      f"(a container?); clocks set within the current mode")
            return False
        conf = nvp.conf()
        mode = conf.resolve(key)
        if mode is None:
            self.note(f"power mode {key!r} skipped: this board has no such mode ({conf.choices()})")
            return False
        cur = self.board.read_mode()
        if cur is not None and cur.id == mode.id:
            return False
        old_mask = self._tpc_mask(conf, cur)
        new_mask = mode.value("TPC_POWER_GATING", "TPC_PG_MASK")
        if old_mask is not None and new_mask is not None and old_mask.strip() != new_mask.strip() \
                and not allow_reboot:
            self.note(f"power mode {mode.name} skipped: it changes the GPU TPC power-gating mask "
                      f"({old_mask.strip()} -> {new_mask.strip()}), which needs a reboot; pass "
                      f"--allow-reboot-modes to switch anyway")
            return False
        self._guarded(lambda: self.board.set_mode(mode.id, self.writer))
        self.applied = None             # nvpmodel rewrote caps: re-apply everything next time
        return True

    def tpc_mask_in_force(self) -> str | None:
        """The TPC power-gating mask in force (None: unknown)."""
        nvp = self.board.nvpmodel
        return self._tpc_mask(nvp.conf(), self.board.read_mode()) if nvp.available else None

    def _tpc_mask(self, conf: NvpModelConf, cur: ModeReading | None) -> str | None:
        """The TPC mask in force: the live file, else the current mode's value in the conf."""
        live = self.board.info.gpu.tpc_pg_mask
        text = sysfs.read_text(self.board.root, live) if live else None
        if text:
            return text
        m = conf.resolve(cur.id) if cur is not None and cur.id is not None else None
        return m.value("TPC_POWER_GATING", "TPC_PG_MASK") if m is not None else None

    def check_mode_caps(self, mode_key: str) -> None:
        """After a switch: note every live cap that did not follow the mode's (a kernel clamp, or a
        tool that changed it since)."""
        if not self.board.nvpmodel.available:
            return
        mode = self.board.nvpmodel.conf().resolve(mode_key)
        if mode is None:
            return
        cap = mode.max_cap("GPU")
        if cap is not None and self.board.gpu.available:
            live = self.board.gpu.read().max_hz
            if live is not None and live > cap:
                self.note(f"GPU max_freq is {live} Hz after switching to {mode.name}, above its cap {cap} Hz")

    def apply(self, d: Decision, fan_ours: bool = False) -> int:
        """Write what changed. Returns the number of domains written."""
        def go() -> int:
            n = 0
            g0, g1, emc, cpu = d.clocks()
            prev = self._still_in_force(self.applied)
            with self.writer.transaction():
                if prev is None or (prev[0], prev[1]) != (g0, g1):
                    self.board.gpu.set_range(self.writer, g0, g1)
                    n += 1
                if prev is None or prev[2] != emc:
                    n += self._emc(emc)
                if prev is None or prev[3] != cpu:
                    for cl in self.board.info.cpu.clusters:
                        if cl.name in self._cpu_min and self.board.cpu.is_online(cl.lead):
                            self.board.cpu.set_range(self.writer, cl.name, min(self._cpu_min[cl.name], cpu), cpu)
                    n += 1
                if fan_ours and d.fan_pwm is not None and d.fan_pwm != self.fan_applied and self.board.fan.available:
                    self.board.set_fan(d.fan_pwm, self.writer)
                    self.fan_applied = d.fan_pwm
                    n += 1
            self.applied = (g0, g1, emc, cpu)
            return n
        n = self._guarded(go)
        self.writes += n
        self._after = self._files()
        for line in self.writer.clamps:
            self.note(f"clamped by the kernel: {line}")
        self.writer.clamps.clear()
        return n

    def _files(self) -> tuple[bytes, ...]:
        """The GPU min/max and EMC lock/rate files as they are now (what another tool would change)."""
        gpu, emc = self.board.info.gpu, self.board.info.emc
        paths = ([f"{gpu.devfreq}/min_freq", f"{gpu.devfreq}/max_freq"] if gpu.devfreq else []) + \
            ([emc.locked or "", emc.rate or ""] if emc.pinnable else [])
        try:
            return tuple(self.writer.read_raw(p).strip() for p in paths)
        except OSError:
            return ()

    def _still_in_force(self, prev: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
        """What we last applied, if the GPU and EMC files still hold what they held after our writes:
        another tool (nvpmodel by hand, jtop, jetson_clocks) may have changed them since; then
        everything is written again."""
        if prev is None or self.writer.dry_run or self._files() == self._after:
            return prev
        self.note("clock files changed by another tool since the last write: writing them again")
        self.emc_locked = False
        return None

    def _emc(self, hz: int) -> int:
        """Pin the EMC (bpmp debugfs); without debugfs cap it (r36 clk_cap) or leave it, with a note."""
        emc = self.board.emc
        if emc.info.pinnable:
            if not self.emc_locked:
                emc.lock(self.writer, hz)
                self.emc_locked = True
            else:
                self.writer.write(emc.info.rate or "", hz, group="emc", role="rate", accept=rate_accept(hz))
            return 1
        if emc.info.control_cap:
            self.note(f"EMC: no bpmp debugfs under {self.board.root}: capped through {emc.info.control_cap} "
                      f"instead of pinned")
            emc.cap(self.writer, hz)
            return 1
        self.note(f"EMC skipped: no bpmp debugfs (and no r36 clk_cap) under {self.board.root}; the EMC "
                  f"stays under the board's own scaling")
        return 0

    def _guarded(self, fn: Callable[[], int | object]) -> int:
        try:
            out = fn()
        except Exception as exc:
            # the writer rolled back its own transaction; put back everything else the journal holds
            try:
                self.restore()
            except OSError as again:
                raise BoardWriteError(f"{exc}\nputting the other files back also failed: {again}") from exc
            raise
        return out if isinstance(out, int) else 0

    def restore(self) -> None:
        self.applied, self.fan_applied, self.emc_locked = None, None, False
        if self.writer.journal is not None:
            self.writer.journal.restore()
