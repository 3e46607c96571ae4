"""Opening the board for control: the one place that goes profile (and the power cap, applied here once)
-> board (one factory, the tools' runner for its root) -> journaled writer -> nvpmodel mode switch (the
budget's choice under a cap) -> rediscovery -> clock tables -> planner -> control loop (the budget
installed on it) -> the board's meter.

Used by the service's controller (:meth:`power.runtime.controller.PowerController.open`), ``orin-agent power
set`` (:func:`apply_profile`) and the energy benchmark (power.bench). Also the default paths every
front end shares (``DEFAULT_ROOT``, ``DEFAULT_RUN_DIR``, ``DEFAULT_PROFILE_DIR``).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from power.runtime.applier import ClockApplier, read_zone_samples, tables_from_board
from power.runtime.board import open_board_at, rediscover
from power.runtime.cap import DEFAULT_SHAPE, budget_config, install, with_cap
from power.runtime.loop import PowerLoop
from power.runtime.meter import BoardMeter, PowerSource
from power.hw.backends import SysfsBoard
from power.hw.journal import DEFAULT_RUN_DIR as _JOURNAL_RUN_DIR
from power.hw.writer import ClockWriter
from power.physics.boards import BOARDS, NANO_SUPER, BoardSpec, board_for
from power.physics.costmodel import ModelShape
from power.policy.dvfs import Decision, DvfsController, DvfsState, Planner, Readings
from power.policy.phase import PhaseEvent
from power.policy.powerconfig import Mix
from power.policy.profiles import DEFAULT_USER_DIR, Profile, ProfileStore
from power.hw.tables import BoardTables
from power.policy.thermal import ZoneSample
from power.runtime.shapes import model_shape
from power.runtime.state import write_state

DEFAULT_ROOT = "/"
DEFAULT_RUN_DIR = _JOURNAL_RUN_DIR          # the restore journal and the controller's state file
DEFAULT_PROFILE_DIR = DEFAULT_USER_DIR      # the user's profiles, over the shipped ones


@dataclass
class Session:
    """An open board under control: the board (rediscovered after the mode switch), its journaled
    writer, the applier that writes decisions, the loop that makes them (``loop.controller``: ``dvfs``, or
    the budget around it), and the board's one meter."""
    board: SysfsBoard
    writer: ClockWriter
    applier: ClockApplier
    loop: PowerLoop
    profile: Profile                # the power cap applied
    spec: BoardSpec | None
    tables: BoardTables
    dvfs: DvfsController
    meter: BoardMeter

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the board did not offer (skipped) or the kernel clamped, one line each."""
        return tuple(self.applier.notes)

    def close(self) -> None:
        """Release the journal's lock, leaving its entries for a later restore."""
        if self.writer.journal is not None:
            self.writer.journal.close()


def spec_of(board: SysfsBoard) -> BoardSpec | None:
    """The published spec of the board the identity names (its L4T line; r36 when unknown), or None."""
    ident = board.info.identity
    if not ident.board or ident.l4t is None:
        return None
    try:
        spec = board_for(ident.board, ident.l4t.layout if ident.l4t.layout in ("r35", "r36") else "r36")
    except KeyError:
        return None
    if spec is NANO_SUPER and not _says_super(board):
        # JetPack 6.0/6.1 Nanos are r36 but not Super (EMC tops at 2133 MHz: ORIN.md field notes)
        return BOARDS["orin-nano-8gb"]
    return spec


def _says_super(board: SysfsBoard) -> bool:
    """The board calls itself Super: its model string, or a MAXN_SUPER mode in its nvpmodel.conf."""
    if "super" in (board.info.identity.model or "").lower():
        return True
    try:
        return board.nvpmodel.available and any("SUPER" in m.name.upper() for m in board.nvpmodel.conf().modes)
    except ValueError:
        return False


def open_session(root: str | os.PathLike[str], run_dir: str | os.PathLike[str], profile: str | Profile,
                 shape: ModelShape | None = None, dry_run: bool = False, *,
                 profile_dir: str | os.PathLike[str] | None = DEFAULT_PROFILE_DIR, precision: str = "int4",
                 fan_ours: bool = False, spec: BoardSpec | None = None,
                 zones: Callable[[], tuple[ZoneSample, ...]] | None = None,
                 echo: Callable[[str], None] | None = None, recover: bool = True,
                 allow_reboot_modes: bool = False, power_cap_w: float | None = None,
                 mix: Mix | None = None, power: PowerSource | None = None) -> Session:
    """Open ``root`` for control with ``profile``: its nvpmodel mode is switched (journaled), the board
    rediscovered, the tables read and, with a model shape (the served model's, or a preset's), the
    cost-model planner built (without one, ``auto`` falls back to a fixed rule). ``spec`` defaults to
    the board's identity; ``zones`` to the board's thermal zones. What the board does not offer (no
    nvpmodel.conf, no such mode, no debugfs) is skipped with a line in ``Session.warnings``; a mode
    switch that needs a reboot (TPC mask) only with ``allow_reboot_modes``. Call it before any CUDA
    context exists (a mode switch changes the GPU's caps under it). With a power budget (the profile's
    ``[budget]``, ``power_cap_w`` over it) the mode and the CPU cores online are the budget's choice
    (``power.runtime.cap.budget_config``, for ``mix``; extra cores are taken offline, journaled) and the
    loop's controller is capped to it, reading its power from ``power`` (default: the session's board
    meter, which the caller samples; the energy bench passes the twin's state). On any error the journal
    is restored and closed before the error propagates."""
    prof = profile if isinstance(profile, Profile) else ProfileStore(
        None if profile_dir is None else os.fspath(profile_dir)).load(profile)
    prof = with_cap(prof, power_cap_w)
    board = open_board_at(root)
    writer = board.writer(run_dir, dry_run=dry_run, echo=echo, recover=recover)
    applier = ClockApplier(board, writer)
    spec = spec if spec is not None else spec_of(board)
    try:
        mode_key, cores = prof.nvpmodel, None
        if prof.budget is not None and spec is not None:
            mode_key, cores = budget_config(applier, spec, prof, shape, precision, allow_reboot_modes, mix)
        if mode_key and applier.set_mode(mode_key, allow_reboot=allow_reboot_modes) \
                and not dry_run:
            if board.backend == "sysfs":
                board = rediscover(board)       # the mode changed caps and cores
                applier.board = board
            applier.check_mode_caps(mode_key)
        if cores is not None and board.cpu.available:
            board.cpu.keep_online(writer, cores)
        tables = tables_from_board(board, spec.emc_hz if spec else ())
        mode = board.read_mode()
        # a budget plans with the cost model: the served model's shape, else the one its configuration was
        # chosen for (power.runtime.cap.DEFAULT_SHAPE, as `power set` has no model)
        plan_shape = shape if shape is not None or prof.budget is None else model_shape(DEFAULT_SHAPE)
        planner = (Planner.for_board(spec, plan_shape, precision, mode.id if mode else None)
                   if spec is not None and plan_shape is not None else None)
        read_zones = zones if zones is not None else (lambda: read_zone_samples(applier.board))
        dvfs = DvfsController(tables, planner)
        meter = BoardMeter(board)
        # auto learns each step's power from the board total (the meter's last sample, or the twin's)
        loop = PowerLoop(dvfs, prof, applier, read_zones, fan_ours=fan_ours,
                         step_power=(power or meter).reader(None))
        if prof.budget is not None:         # the cap's one installation: the loop decides under it
            install(loop, prof.budget, (power or meter).reader(prof.budget.rail), mix, cores)
    except Exception:
        applier.restore()
        if writer.journal is not None:
            writer.journal.close()
        raise
    return Session(board, writer, applier, loop, prof, spec, tables, dvfs, meter)


@dataclass(frozen=True)
class Applied:
    """What ``power set`` did: the profile, the idle decision written, and what was skipped."""
    profile: Profile
    decision: Decision
    warnings: tuple[str, ...]


def apply_profile(root: str | os.PathLike[str], run_dir: str | os.PathLike[str], name: str, *,
                  profile_dir: str | os.PathLike[str] | None = DEFAULT_PROFILE_DIR, dry_run: bool = False,
                  echo: Callable[[str], None] | None = None, allow_reboot_modes: bool = False,
                  power_cap_w: float | None = None) -> Applied:
    """``orin-agent power set``: apply a profile's power mode and idle clocks now, journaled (``power
    restore`` undoes it), leave the journal for that restore and record the state file (with the
    warnings, so ``power status`` shows them, and the budget, ``power_cap_w`` over the profile's
    ``[budget]``: the controller holds it while it runs)."""
    prof = ProfileStore(None if profile_dir is None else os.fspath(profile_dir)).load(name)
    if not Path(root).is_dir():
        raise FileNotFoundError(f"--root {root}: no such directory")
    session = open_session(root, run_dir, prof, None, dry_run, profile_dir=profile_dir, echo=echo,
                           recover=False, allow_reboot_modes=allow_reboot_modes, power_cap_w=power_cap_w)
    prof = session.profile
    try:     # the idle clocks of the profile itself (the budget caps busy phases, not idle)
        d, _ = session.dvfs.decide(Readings(), PhaseEvent("idle"), prof, DvfsState(), 0.0)
        session.applier.apply(d)
    finally:
        session.close()
    if not dry_run:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_state(run_dir, {"profile": session.profile.name, "phase": "idle", "set_by": "orin-agent power set",
                              "decision": {"gpu_min_hz": d.gpu_min_hz, "gpu_max_hz": d.gpu_max_hz,
                                           "emc_hz": d.emc_hz, "cpu_max_khz": d.cpu_max_khz,
                                           "reason": d.reason},
                              "warnings": list(session.warnings),
                              "budget": None if prof.budget is None else {"watts": prof.budget.watts,
                                                                          "window_s": prof.budget.window_s}})
    return Applied(session.profile, d, session.warnings)
