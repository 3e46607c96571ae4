"""Backends behind one board interface, and the factory that picks one.

- :class:`SysfsBoard` reads and writes the files discovery found under the root (the board or the
  twin: they differ only in the root).
- :class:`JtopBoard` takes readings (rails, temperatures, fan, power mode) and the nvpmodel /
  jetson_clocks / fan setters from jetson-stats' ``jtop`` service when it runs (root ``/`` only).
  jtop has no GPU/EMC/CPU frequency setters (ORIN.md), so those stay on sysfs.

:func:`open_board` is the only place that chooses the backend. The tools' runner is the caller's: the
real tools by default on the machine's own ``/``; on any other root (a twin tree) whoever opens it passes
the twin's (power.runtime.board.open_board_at does), else :class:`power.hw.tools.NoTools` refuses them, so
this layer never imports the simulator above it. ``jtop`` is imported lazily: it is optional
(``pip install orin-agent[jetson]``) and AGPL; it is used only through its public API.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

from power.hw import sysfs
from power.hw.errors import FeatureUnavailable
from power.hw.cpu import CpuFreq
from power.hw.discovery import BoardInfo, discover
from power.hw.emc import Emc
from power.hw.fan import PWM_MAX, Fan, FanReading
from power.hw.gpu import GpuClock
from power.hw.jetson_clocks import JetsonClocks
from power.hw.journal import DEFAULT_RUN_DIR, BoardIO, Journal
from power.hw.nvpmodel import ModeChange, ModeReading, NvpModel
from power.hw.rails import PowerRails, RailReading
from power.hw.thermal import ThermalZones, ZoneReading
from power.hw.tools import NoTools, Runner, run_tool
from power.hw.writer import ClockWriter

log = logging.getLogger("orin_agent.power")
JTOP_SOCKET = "/run/jtop.sock"  # ORIN.md: jtop.service listens here


class SysfsBoard:
    """The board as files under ``root``: one object per domain, plus the write allowlist."""

    backend = "sysfs"

    def __init__(self, root: str | os.PathLike[str] = "/", *, info: BoardInfo | None = None,
                 runner: Runner | None = None) -> None:
        self.info = info or discover(root)
        self.root = self.info.root
        if runner is None:      # the caller's choice; without one, the real tools only on the host's own /
            runner = run_tool if sysfs.root_is_host(self.root) else NoTools(self.root)
        self.gpu = GpuClock(self.root, self.info.gpu)
        self.emc = Emc(self.root, self.info.emc)
        self.cpu = CpuFreq(self.root, self.info.cpu)
        self.thermal = ThermalZones(self.root, self.info.zones)
        self.rails = PowerRails(self.root, self.info.rails)
        self.fan = Fan(self.root, self.info.fan)
        self.nvpmodel = NvpModel(self.root, self.gpu, self.emc, self.cpu, runner)
        self.jetson_clocks = JetsonClocks(self.root, self.gpu, self.emc, self.cpu, self.fan, runner=runner)
        self.runner = runner

    # -- the write allowlist: only what discovery identified as a clock/fan file ---------------

    def writable(self) -> dict[str, str]:
        """The one allow-list: the clock and fan files (caps, core online state, TPC gating and
        nvpmodel's status are the tools' to write, never the agent's)."""
        return {**self.gpu.writable(), **self.emc.writable(), **self.cpu.writable(), **self.fan.writable()}

    def writer(self, run_dir: str | os.PathLike[str] = DEFAULT_RUN_DIR, *, dry_run: bool = False,
               echo: Callable[[str], None] | None = None, recover: bool = True,
               io: BoardIO | None = None) -> ClockWriter:
        """A writer for this board. Not a dry run: opens (and first recovers) the journal."""
        journal = None if dry_run else Journal(run_dir, self.root, recover=recover, io=io)
        return ClockWriter(self.root, self.writable(), journal, io=io, dry_run=dry_run, echo=echo)

    # -- readings (the parts a backend may take from elsewhere) --------------------------------

    def read_zones(self) -> tuple[ZoneReading, ...]:
        return self.thermal.read()

    def read_rails(self) -> tuple[RailReading, ...]:
        return self.rails.read()

    def read_fan(self) -> FanReading | None:
        return self.fan.read() if self.fan.available else None

    def read_mode(self) -> ModeReading | None:
        return self.nvpmodel.current()

    # -- setters a backend may take over --------------------------------------------------------

    def set_mode(self, mode: int | str, writer: ClockWriter) -> ModeChange:
        return self.nvpmodel.set_mode(mode, writer)

    def set_fan(self, pwm: int, writer: ClockWriter) -> None:
        self.fan.set_pwm(writer, pwm)

    def set_jetson_clocks(self, writer: ClockWriter, *, fan: bool = False) -> None:
        self.jetson_clocks.apply(writer, fan=fan)

    def close(self) -> None:
        pass

    def __enter__(self) -> "SysfsBoard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JtopBoard(SysfsBoard):
    """Readings and nvpmodel/jetson_clocks/fan through a running ``jtop`` service; clocks on sysfs."""

    backend = "jtop"

    def __init__(self, jetson: Any, root: str | os.PathLike[str] = "/", *, info: BoardInfo | None = None,
                 runner: Runner | None = None, errors: tuple[type[Exception], ...] = (OSError,)) -> None:
        super().__init__(root, info=info, runner=runner)
        self.jetson = jetson
        self._errors = errors       # jtop's JtopException (and OSError) when its thread or service died

    def _alive(self) -> bool:
        """jtop's data is live (``ok()``); False when its thread died, so readings come from sysfs
        and temperatures cannot freeze at the last value jtop saw."""
        ok = getattr(self.jetson, "ok", None)
        if ok is None:
            return True
        try:
            ok()
        except self._errors as exc:
            log.warning("jtop stopped answering (%s): reading the board from sysfs", exc)
            return False
        return True

    def read_zones(self) -> tuple[ZoneReading, ...]:
        if not self._alive():
            return super().read_zones()
        trips = {z.name: z.trips for z in self.thermal.read()}
        out = []
        for name, t in dict(self.jetson.temperature).items():
            online = bool(t.get("online", True)) and t.get("temp", -256) > -256
            key = name.lower()
            out.append(ZoneReading(key, name, float(t["temp"]) if online else None, trips.get(key, ())))
        return tuple(out)

    def read_rails(self) -> tuple[RailReading, ...]:
        if not self._alive():
            return super().read_rails()
        power = dict(self.jetson.power)
        rails = dict(power.get("rail", {}))
        # jetson-stats moves the board total (VDD_IN on NX/Nano) out of "rail" into "tot" (ORIN.md
        # field notes): keep it as its own rail so the total is VDD_IN, not a sum of sub-rails
        tot = power.get("tot") or {}
        if tot.get("name") and tot["name"] not in rails and tot.get("volt") is not None:
            rails[tot["name"]] = tot
        return tuple(RailReading(name, r.get("volt"), r.get("curr"), r.get("crit"))
                     for name, r in rails.items() if r.get("online", True))

    def read_fan(self) -> FanReading | None:
        fan = self.jetson.fan
        try:
            speed = fan.speed  # percent, as jtop reports it
        except AttributeError:
            return super().read_fan()
        return FanReading(round(float(speed) * PWM_MAX / 100.0)) if speed is not None else None

    def read_mode(self) -> ModeReading | None:
        mode = self.jetson.nvpmodel
        if not mode:
            return super().read_mode()
        return ModeReading(getattr(mode, "id", None), getattr(mode, "name", str(mode)), "jtop")

    def set_mode(self, mode: int | str, writer: ClockWriter) -> ModeChange:
        if writer.dry_run:
            if writer.echo:
                writer.echo(f"would set power mode {mode} through jtop")
            return ModeChange(ModeReading(None, str(mode), "dry run"), (), ())
        self.jetson.nvpmodel = int(mode) if str(mode).isdigit() else mode
        return ModeChange(self.read_mode() or ModeReading(None, str(mode), "jtop"), (f"nvpmodel {mode}",), ())

    def set_fan(self, pwm: int, writer: ClockWriter) -> None:
        if not 0 <= pwm <= PWM_MAX:
            raise ValueError(f"fan PWM must be 0-{PWM_MAX}, got {pwm}")
        if self.fan.available and writer.journal is not None:  # so a restore puts it back
            writer.journal.record(self.info.fan.pwm or "", writer.read_raw(self.info.fan.pwm or ""), "fan", "pwm")
        if writer.dry_run:
            if writer.echo:
                writer.echo(f"would set the fan to {pwm}/255 through jtop")
            return
        # without the manual profile nvfancontrol rewrites the PWM within ~2 s (ORIN.md field notes)
        if getattr(self.jetson.fan, "profile", "manual") != "manual":
            self.jetson.fan.profile = "manual"
        self.jetson.fan.speed = round(100.0 * pwm / PWM_MAX)

    def set_jetson_clocks(self, writer: ClockWriter, *, fan: bool = False) -> None:
        for path in self.jetson_clocks.own_files():
            if writer.journal is not None and writer.is_allowed(path):
                writer.journal.record(sysfs.to_board(self.root, sysfs.resolve(self.root, path)), writer.read_raw(path))
        if writer.dry_run:
            if writer.echo:
                writer.echo("would turn jetson_clocks on through jtop")
            return
        self.jetson.jetson_clocks = True

    def close(self) -> None:
        close = getattr(self.jetson, "close", None)
        if close is not None:
            close()


def jtop_available(root: str | os.PathLike[str]) -> bool:
    """jtop can serve this root: the root is the host, jetson-stats is installed, its service runs."""
    return (sysfs.root_is_host(root) and importlib.util.find_spec("jtop") is not None
            and os.path.exists(JTOP_SOCKET))


def open_board(root: str | os.PathLike[str] = "/", *, backend: str = "auto",
               runner: Runner | None = None) -> SysfsBoard:
    """The one factory: ``auto`` (jtop when its service runs on this host, else sysfs), ``sysfs``
    or ``jtop`` (an error if it cannot be used)."""
    if backend not in ("auto", "sysfs", "jtop"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, sysfs or jtop)")
    if backend == "sysfs" or (backend == "auto" and not jtop_available(root)):
        return SysfsBoard(root, runner=runner)
    if not jtop_available(root):
        raise FeatureUnavailable(f"jtop backend needs root '/', the jetson-stats package and {JTOP_SOCKET}")
    module = importlib.import_module("jtop")
    # the jtop client refuses a service of another major.minor (and raises JtopException when the
    # service is down): in auto mode that is a warning and the board is read from sysfs
    errors: tuple[type[Exception], ...] = (OSError,)
    exc_type = getattr(module, "JtopException", None)
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        errors = (exc_type, OSError)
    try:
        jetson = module.jtop()
        jetson.start()
    except errors as exc:
        if backend == "jtop":
            raise FeatureUnavailable(f"jtop backend: {exc} (install the jetson-stats version of the board's "
                                     f"jtop service: `jtop --version`)") from exc
        log.warning("jtop unusable (%s): reading the board from sysfs; pin jetson-stats to the board's "
                    "jtop service version", exc)
        return SysfsBoard(root, runner=runner)
    return JtopBoard(jetson, root, runner=runner, errors=errors)
