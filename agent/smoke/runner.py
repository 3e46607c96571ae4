"""The order of the smoke checks and the run around them: the board opened and pictured first, the
twin's board model started before the clock round trips (so clocks settle and readings move) and
stopped before the final comparison, which always runs, whatever failed before it. The run holds the
board lock (power.hw.rootlock); beside another owner the checks that write are skipped, naming it."""
from __future__ import annotations

import time
from collections.abc import Callable

from agent.smoke import board_checks as b
from agent.smoke import stack_checks as s
from agent.smoke.context import SmokeContext, SmokeOptions, is_twin
from agent.smoke.result import Check, CheckResult, Outcome, SmokeReport, run_checks, skipped
from power.hw.rootlock import BoardBusy, BoardLock

_BOARD = "see the message; `orin-agent power status` shows what the agent reads"


def _started(check: Callable[[SmokeContext], Outcome]) -> Callable[[SmokeContext], Outcome]:
    """Start the twin's model (a no-op on a board) before a check that needs clocks to move."""
    def run(ctx: SmokeContext) -> Outcome:
        ctx.start_driver()
        return check(ctx)
    return run


CHECKS: tuple[Check[SmokeContext], ...] = (
    Check("board", "board identified", b.check_identity, "check --root: the board's / or a twin folder"),
    Check("interfaces", "interfaces discovered", b.check_interfaces, _BOARD),
    Check("permissions", "permissions", b.check_permissions, b.REMEDY_ROOT),
    Check("clock-gpu", "GPU clock round trip", _started(b.check_gpu_clock), _BOARD),
    Check("clock-emc", "EMC clock round trip", _started(b.check_emc_clock), _BOARD),
    Check("clock-cpu", "CPU clock round trip", _started(b.check_cpu_clock), _BOARD),
    Check("sensors", "sensors alive", _started(b.check_sensors), _BOARD),
    Check("versions", "Python, torch, CUDA, ONNX Runtime", s.check_versions, "see docs/ON_DEVICE.md"),
    Check("tensorrt", "TensorRT", s.check_tensorrt, "see docs/ON_DEVICE.md"),
    Check("engines", "engines match the manifest", s.check_engines, "rebuild with `orin-agent build`"),
    Check("generation", "short generation", _started(s.check_generation), "see the message; "
          "`orin-agent generate` runs the same engine"),
    Check("controller", "controller switches clocks", s.check_controller, _BOARD),
    Check("energy", "energy per token", s.check_energy, _BOARD),
    Check("ready", "service /ready", s.check_ready, "see journalctl -u orin-agent"),
    Check("unchanged", "board as before", b.check_unchanged, "run `orin-agent power restore`"),
)
# With --quick the checks that cost seconds and prove the least on a healthy install are skipped.
QUICK_SKIP = frozenset({"engines"})
# The checks of the board alone (no model loaded): what the tests run on every twin board and layout.
BOARD_CHECKS = frozenset({"board", "interfaces", "permissions", "clock-gpu", "clock-emc", "clock-cpu",
                          "sensors", "unchanged"})


def run_smoke(options: SmokeOptions, on_result: Callable[[CheckResult], None] | None = None,
              only: frozenset[str] | None = None) -> SmokeReport:
    """Run every check (or those named in ``only``) in order on ``options.root``; the twin's model is
    always stopped at the end."""
    t0 = time.monotonic()
    ctx = SmokeContext(options, is_twin(options.root))
    try:  # the board's one owner for the whole run; beside another owner (a service) only reads
        lock: BoardLock | None = BoardLock(options.root, "orin-agent smoke")
    except BoardBusy as exc:
        lock, ctx.board_busy = None, str(exc)
    checks = tuple(c if not (options.quick and c.name in QUICK_SKIP) else
                   Check(c.name, c.title, lambda _ctx: skipped("--quick"), c.remedy)
                   for c in CHECKS if only is None or c.name in only or c.name == "board")
    try:
        results = run_checks(checks, ctx, on_result)
    finally:
        ctx.stop_driver()
        if ctx.board is not None:
            ctx.board.close()
        if lock is not None:
            lock.close()
    return SmokeReport(options.root, ctx.twin, results, time.monotonic() - t0)
