"""The smoke checks of the board itself: identified, interfaces discovered, permissions, a clock write ->
read-back -> restore round trip on the GPU, the EMC and the CPU (settle time measured), sensors alive
and plausible, and at the end the board exactly as it was. Every change goes through the journaled
writer (power.hw.writer) and is restored through its journal."""
from __future__ import annotations

import getpass
import math
import os
import time
from collections.abc import Callable

from agent.smoke.context import BoardPicture, SmokeContext, read_files, settable_files, tree_files
from agent.smoke.result import Outcome, SkipCheck, failed, passed, skipped
from power.hw import sysfs
from power.hw.backends import JTOP_SOCKET, SysfsBoard, jtop_available
from power.hw.errors import JournalError
from power.hw.rootlock import BoardBusy
from power.hw.writer import ClockWriter
from power.physics.boards import board_for
from power.runtime.board import open_board_at

# L4T -> JetPack, from NVIDIA's JetPack archive (developer.nvidia.com/embedded/jetpack-archive).
JETPACK = {"35.1": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3",
           "35.6.0": "5.1.4", "36.2": "6.0 DP", "36.3": "6.0", "36.4": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1"}
# Plausible temperatures: no Orin module is specified below -40 °C (Jetson AGX Orin Industrial data
# sheet, operating range), and above the 104.5 °C critical trip the board shuts down (ORIN.md, thermal).
TEMP_RANGE_C = (-40.0, 104.5)
# Plausible rail readings: the INA3221 measures bus voltages up to 26 V (TI INA3221 data sheet, "bus
# voltage 0 V to 26 V"); a negative current on these supply rails means a broken channel.
RAIL_MAX_MV = 26000
POLL_S = 0.01

ESSENTIAL = ("GPU clock", "CPU clocks", "thermal", "power rails")
REMEDY_ROOT = "run it as root (sudo orin-agent smoke) or install the service, whose unit runs as root"


def _board(ctx: SmokeContext) -> SysfsBoard:
    if ctx.board is None:
        raise SkipCheck("the board could not be opened (see the first check)")
    return ctx.board


def check_identity(ctx: SmokeContext) -> Outcome:
    root = ctx.root
    if not os.path.isdir(root):
        return failed(f"--root {root}: no such directory", "pass the board's root (/) or a twin folder")
    ctx.board = open_board_at(root)
    ctx.before = BoardPicture(read_files(ctx.board.root, settable_files(ctx.board)),
                              tree_files(root) if ctx.twin else None)
    ident = ctx.board.info.identity
    mode = ctx.board.read_mode()
    l4t = ident.l4t.release if ident.l4t else None
    jp = next((v for k, v in sorted(JETPACK.items(), key=lambda kv: -len(kv[0])) if l4t and l4t.startswith(k)), "?")
    mode_s = f"{mode.name or 'unnamed'} (id {mode.id}, from {mode.source})" if mode else "unknown"
    detail = (f"{ident.model or '?'} [{ident.module or '?'}{' = ' + ident.board if ident.board else ''}], "
              f"L4T {l4t or '?'} (JetPack {jp}), power mode {mode_s}{' (twin)' if ctx.twin else ''}")
    data = {"model": ident.model, "module": ident.module, "board": ident.board, "l4t": l4t, "jetpack": jp,
            "power_mode": mode.name if mode else None, "backend": ctx.board.backend}
    if not ident.is_orin:
        return failed(f"not a Jetson Orin: {detail}", "run it on the board (root /) or on a twin "
                      "(orin-agent twin create DIR, then --root DIR)", **data)
    if ident.l4t is None:
        return failed(f"no L4T release: {detail}", "/etc/nv_tegra_release is missing: reinstall JetPack's "
                      "nvidia-l4t-core package", **data)
    return passed(detail, **data)


def check_interfaces(ctx: SmokeContext) -> Outcome:
    info = _board(ctx).info
    missing = list(info.unavailable)
    jtop = jtop_available(ctx.root)
    if sysfs.root_is_host(ctx.root) and not jtop:
        missing.append(f"jtop service: not running ({JTOP_SOCKET} missing; optional: "
                       "pip install orin-agent[jetson] and enable jtop.service)")
    found = [n for n, ok in (("GPU", info.gpu.devfreq), ("EMC", info.emc.rate), ("CPU", info.cpu.clusters),
                             (f"{len(info.zones)} thermal zones", info.zones),
                             (f"{len(info.rails)} rails", info.rails), ("fan", info.fan.pwm),
                             ("nvpmodel.conf", info.nvpmodel_conf), ("jtop", jtop)) if ok]
    data = {"missing": "; ".join(missing), "backend": ctx.board.backend if ctx.board else None}
    lost = [m for m in missing if m.split(":")[0] in ESSENTIAL]
    if lost:
        return failed(f"missing: {'; '.join(lost)}", "check that the L4T kernel's drivers are loaded "
                      "(a stock JetPack has them) and that --root is the board's root", **data)
    detail = f"found {', '.join(found)}"
    return passed(detail + (f"; missing: {'; '.join(missing)}" if missing else ""), **data)


def check_permissions(ctx: SmokeContext) -> Outcome:
    board = _board(ctx)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):     # no passwd entry (a bare container)
        user = f"uid {os.geteuid()}"
    files = board.writable()
    if not files:
        return failed("no clock file was discovered to write", "see the interfaces check")
    denied = [p for p in files if not os.access(sysfs.resolve(board.root, p), os.W_OK)]
    if denied:
        return failed(f"{len(denied)} of {len(files)} clock files are not writable as {user}: "
                      f"{', '.join(sorted(denied)[:3])}", REMEDY_ROOT, user=user)
    note = " (root: file modes do not bind it; the round trips below prove the writes)" if os.geteuid() == 0 else ""
    return passed(f"{len(files)} clock/fan files writable as {user}{note}", user=user)


# -- clock round trips ---------------------------------------------------------------------------------

def _writer(ctx: SmokeContext) -> ClockWriter | Outcome:
    board = _board(ctx)
    try:
        return board.writer(ctx.options.run_dir)
    except JournalError as exc:
        if isinstance(exc, BoardBusy) or "another process" in str(exc):
            ctx.board_busy = str(exc)
            return skipped(f"the board is in use: {exc}")
        raise


def _settle(read: Callable[[], int | None], ok: Callable[[int], bool], timeout_s: float) -> tuple[float | None, int | None]:
    """Seconds until ``read()`` satisfies ``ok`` (None if it never did within the timeout), last value."""
    t0 = time.monotonic()
    v = read()
    while v is None or not ok(v):
        if time.monotonic() - t0 > timeout_s:
            return None, v
        time.sleep(POLL_S)
        v = read()
    return time.monotonic() - t0, v


def _other(table: tuple[int, ...], cur: int | None) -> int:
    """A table value other than ``cur``: the middle one, or its neighbour when that is ``cur``."""
    mid = len(table) // 2
    return table[mid] if table[mid] != cur or len(table) == 1 else table[mid - 1]


def _round_trip(ctx: SmokeContext, what: str, unit: float, unit_s: str, apply: Callable[[ClockWriter], int],
                read: Callable[[], int | None], files: tuple[str, ...]) -> Outcome:
    if ctx.board_busy:
        ctx.reset_twin_readings()
        return skipped(f"the board is in use: {ctx.board_busy}")
    w = _writer(ctx)
    if isinstance(w, Outcome):
        return w
    root = _board(ctx).root
    before = read_files(root, files)
    try:
        t0 = time.monotonic()
        target = apply(w)
        write_s = time.monotonic() - t0
        settle_s, got = _settle(read, lambda v: v == target, ctx.options.settle_timeout_s)
        assert w.journal is not None
        t1 = time.monotonic()
        w.journal.restore()
        restore_s = time.monotonic() - t1
    finally:
        if w.journal is not None:
            w.journal.close()
    after = read_files(root, files)
    changed = [p for p in files if before[p] != after[p]]
    data = {"target": target, "write_ms": round(write_s * 1e3, 2), "restore_ms": round(restore_s * 1e3, 2),
            "settle_ms": None if settle_s is None else round(settle_s * 1e3, 1)}
    if changed:
        return failed(f"restore left {', '.join(changed)} changed", "run `orin-agent power restore` and report "
                      "the bug", **data)
    if settle_s is None:
        return failed(f"{what} set to {target / unit:.0f} {unit_s} (read back ok) but it runs at "
                      f"{'?' if got is None else f'{got / unit:.0f}'} {unit_s} after {ctx.options.settle_timeout_s:g} s",
                      "something else holds the clock (jetson_clocks, another controller, a thermal cap): "
                      "check `orin-agent power status`", **data)
    return passed(f"{what} -> {target / unit:.0f} {unit_s}: written and read back in {write_s * 1e3:.1f} ms, "
                  f"settled in {settle_s * 1e3:.0f} ms, restored in {restore_s * 1e3:.1f} ms", **data)


def check_gpu_clock(ctx: SmokeContext) -> Outcome:
    b = _board(ctx)
    if not b.gpu.available or not b.info.gpu.available_hz:
        return skipped("no GPU devfreq node (see interfaces)")
    target = _other(b.info.gpu.available_hz, b.gpu.read().cur_hz)

    def apply(w: ClockWriter) -> int:
        lo, _ = b.gpu.set_range(w, target, target)
        return lo

    return _round_trip(ctx, "GPU", 1e6, "MHz", apply, lambda: b.gpu.read().cur_hz, tuple(b.gpu.writable()))


def _emc_table(ctx: SmokeContext) -> tuple[int, ...]:
    b = _board(ctx)
    ident = b.info.identity
    if ident.board and ident.l4t:
        try:
            return board_for(ident.board, ident.l4t.layout).emc_hz
        except KeyError:
            pass
    r = b.emc.read()
    return tuple(sorted({f for f in (r.min_hz, r.max_hz) if f}))


def check_emc_clock(ctx: SmokeContext) -> Outcome:
    b = _board(ctx)
    if not b.emc.info.pinnable:
        capped = " (the agent caps it through nvpmodel's clk_cap instead)" if b.emc.info.control_cap else ""
        return skipped("no EMC clock files: bpmp debugfs (/sys/kernel/debug/bpmp/debug/clk/emc) is missing"
                       f"{capped} (mount debugfs: sudo mount -t debugfs none /sys/kernel/debug)")
    r = b.emc.read()
    table = tuple(f for f in _emc_table(ctx) if (r.min_hz or 0) <= f <= (r.max_hz or f) and f <= (r.cap_hz or f))
    if not table:
        return skipped("no EMC rate is known within min/max_rate and the power mode's cap")
    target = _other(table, r.cur_hz)

    def apply(w: ClockWriter) -> int:
        b.emc.lock(w, target)
        return target

    return _round_trip(ctx, "EMC", 1e6, "MHz", apply, lambda: b.emc.read().cur_hz, tuple(b.emc.writable()))


def check_cpu_clock(ctx: SmokeContext) -> Outcome:
    b = _board(ctx)
    if not b.info.cpu.clusters:
        return skipped("no cpufreq files (see interfaces)")
    cl = b.info.cpu.clusters[0]
    cur = b.cpu.read()[0].cur_khz
    target = _other(cl.available_khz, cur)

    def apply(w: ClockWriter) -> int:
        lo, _ = b.cpu.set_range(w, cl.name, target, target)
        return lo

    return _round_trip(ctx, f"CPU {cl.name}", 1e3, "MHz", apply, lambda: b.cpu.read()[0].cur_khz,
                       tuple(b.cpu.writable()))


# -- sensors -------------------------------------------------------------------------------------------

def check_sensors(ctx: SmokeContext) -> Outcome:
    b = _board(ctx)
    zones, rails = b.read_zones(), b.read_rails()
    bad = [f"zone {z.name} ({z.type}) offline: its temp file cannot be read" for z in zones if z.temp_c is None]
    bad += [f"zone {z.name} reads {z.temp_c:.1f} °C, outside {TEMP_RANGE_C[0]:g}..{TEMP_RANGE_C[1]:g} °C"
            for z in zones if z.temp_c is not None and not TEMP_RANGE_C[0] <= z.temp_c <= TEMP_RANGE_C[1]]
    for r in rails:
        if r.mv is None or r.ma is None:
            bad.append(f"rail {r.label} unreadable (in/curr input missing)")
        elif not 0 <= r.mv <= RAIL_MAX_MV or r.ma < 0:
            bad.append(f"rail {r.label} reads {r.mv} mV / {r.ma} mA: implausible")
    if not zones or not rails:
        bad.append("no " + " and no ".join(w for w, got in (("thermal zones", zones), ("power rails", rails)) if not got))
    total = b.rails.total_mw(rails)
    hot = max((z.temp_c for z in zones if z.temp_c is not None), default=math.nan)
    data = {"zones": len(zones), "rails": len(rails), "total_mw": total, "max_c": hot}
    if bad:
        return failed("; ".join(bad), "a sensor driver is missing or failing: check `dmesg` for ina3221 / "
                      "thermal errors and that the L4T kernel's modules are loaded", **data)
    return passed(f"{len(zones)} zones (hottest {hot:.1f} °C), {len(rails)} rails "
                  f"({(total or 0) / 1000:.2f} W in total), all plausible", **data)


# -- the end -------------------------------------------------------------------------------------------

def check_unchanged(ctx: SmokeContext) -> Outcome:
    """The board's settable files as before; on a twin the whole tree (outside run/), byte for byte."""
    ctx.stop_driver()
    if ctx.before is None or ctx.board is None:
        return skipped("the board was never opened")
    if ctx.board_busy:
        ctx.reset_twin_readings()
        return skipped("another process holds the board (the service?): this run wrote nothing, and the "
                       "files are that process's to change and restore")
    # Two settable files also move on their own: the EMC rate reads the clock's actual rate while it
    # is unlocked (bpmp), and the fan's PWM follows nvfancontrol. The lock and the rest say whether
    # the agent left anything set; on a twin the tree comparison below covers those two as well.
    live = {p for p in (ctx.board.info.emc.rate, ctx.board.info.fan.pwm) if p}
    now = read_files(ctx.board.root, tuple(p for p in ctx.before.settable if p not in live))
    changed = sorted(p for p, v in now.items() if v != ctx.before.settable[p])
    if changed:
        return failed(f"{len(changed)} board file(s) differ from before: {', '.join(changed[:4])}",
                      f"run `orin-agent power restore --root {ctx.root} --run-dir {ctx.options.run_dir}`",
                      changed=len(changed))
    if ctx.before.tree is None:
        return passed(f"{len(now)} clock, cap and mode files as before")
    reset = ctx.reset_twin_readings()
    tree = tree_files(ctx.root)
    diff = sorted(set(tree) ^ set(ctx.before.tree) | {p for p in tree if ctx.before.tree.get(p, tree[p]) != tree[p]})
    if diff:
        return failed(f"{len(diff)} twin file(s) differ from before: {', '.join(diff[:4])}",
                      "report the bug; recreate the twin (orin-agent twin create)", changed=len(diff))
    return passed(f"{len(now)} clock, cap and mode files as before; the whole twin tree ({len(tree)} files) "
                  f"byte-identical once its {reset} simulated readings were put back", files=len(tree))
