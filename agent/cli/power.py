"""`orin-agent power ...`: board status and restore. Thin: every value comes from ``power``; this file
only turns a :class:`power.runtime.status.BoardStatus` into a table (people) or JSON (scripts)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from agent.cli import profiles
from agent.cli.common import cli_errors, root_option, run_dir_option
from power.runtime.board import open_board_at
from power.runtime.state import clear_state, describe_state, read_state
from power.hw.journal import read_journal, restore_run_dir
from power.hw.rootlock import BoardLock
from power.runtime.status import BoardStatus, read_status

app = typer.Typer(help="Read the board's clocks, temperatures and power; restore what the agent changed.",
                  no_args_is_help=True)

def _check_root(root: Path) -> str:
    if not root.is_dir():
        raise FileNotFoundError(f"--root {root}: no such directory")
    return os.fspath(root)


def _mhz(v: int | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v / (1e6 if unit == 'Hz' else 1e3):.1f}"


def render_status(st: BoardStatus, state: dict | None = None) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("board", escape(f"{st.model or '?'}  [{st.module or '?'}{' = ' + st.board if st.board else ''}]"))
    head.add_row("L4T", f"{st.l4t or '?'} ({st.l4t_layout or '?'} layout)")
    mode = st.power_mode
    head.add_row("power mode", f"{mode.name} (id {mode.id}, from {mode.source})" if mode else "-")
    head.add_row("root / backend", f"{st.root} / {st.backend}")
    total = f"{st.total_mw / 1000:.2f} W" if st.total_mw is not None else "-"
    fan = f"{st.fan_pwm}/255" if st.fan_pwm is not None else "-"
    head.add_row("total power / fan", f"{total} / {fan}")
    head.add_row("power controller", escape(describe_state(state)))

    clocks = Table(title="clocks (MHz)", title_justify="left")
    for col in ("clock", "cur", "min", "max", "notes"):
        clocks.add_column(col, justify="right" if col in ("cur", "min", "max") else "left")
    for c in st.clocks:
        d = c.detail
        notes = []
        if d.get("load_pct") is not None:
            notes.append(f"load {d['load_pct']:.0f}%")
        if d.get("cap"):
            notes.append(f"cap {c_fmt(d['cap'])}")
        if d.get("locked"):
            notes.append("locked")
        if d.get("util_pct") is not None:
            notes.append(f"util {d['util_pct']:.0f}%")
        if "online" in d:
            notes.append(f"online {len(d['online'])}/{len(d['cpus'])}")
        if d.get("governor"):
            notes.append(str(d["governor"]))
        clocks.add_row(c.name, _mhz(c.cur, c.unit), _mhz(c.min, c.unit), _mhz(c.max, c.unit), ", ".join(notes))

    zones = Table(title="thermal zones (°C)", title_justify="left")
    for col in ("zone", "temp", "trips"):
        zones.add_column(col, justify="right" if col == "temp" else "left")
    for z in st.zones:
        trips = ", ".join(f"{t.type} {t.temp_c:g}" for t in z.trips if t.temp_c is not None)
        zones.add_row(z.type, f"{z.temp_c:.1f}" if z.temp_c is not None else "offline", trips)

    rails = Table(title="power rails", title_justify="left")
    for col in ("rail", "mV", "mA", "mW"):
        rails.add_column(col, justify="left" if col == "rail" else "right")
    for r in st.rails:
        rails.add_row(r.label, str(r.mv) if r.mv is not None else "-", str(r.ma) if r.ma is not None else "-",
                      f"{r.mw:.0f}" if r.mw is not None else "-")
    parts: list[object] = [head, clocks, zones, rails]
    if st.unavailable:
        parts.append("[yellow]unavailable here:[/yellow]\n  " + "\n  ".join(st.unavailable))
    return Group(*parts)  # type: ignore[arg-type]


def c_fmt(hz: int) -> str:
    return f"{hz / 1e6:.0f}"


@app.command("status")
def status(root: Path = root_option(),
           json_out: bool = typer.Option(False, "--json", help="Print JSON (one object per sample)."),
           watch: bool = typer.Option(False, "--watch", help="Refresh until Ctrl-C."),
           interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between samples with --watch."),
           backend: str = typer.Option("auto", "--backend", help="auto, sysfs or jtop."),
           run_dir: Path = run_dir_option("The service's run directory (its power controller's state).")) -> None:
    """Board, L4T, power mode, every clock (cur/min/max), zone temperatures, rails and total power, fan,
    and the power controller's profile, phase and last decision when a service runs."""
    with cli_errors():
        board = open_board_at(_check_root(root), backend=backend)
        try:
            if not watch:
                _emit(read_status(board), read_state(run_dir), json_out)
                return
            try:
                _watch(board, run_dir, json_out, interval)
            except KeyboardInterrupt:
                return  # Ctrl-C is how --watch ends
        finally:
            board.close()


def _watch(board: object, run_dir: Path, json_out: bool, interval: float) -> None:
    from rich.live import Live

    if json_out:  # JSON lines: one compact object per sample
        while True:
            data = {**read_status(board).to_dict(), "controller": read_state(run_dir)}  # type: ignore[arg-type]
            sys.stdout.write(json.dumps(data, default=str) + "\n")
            sys.stdout.flush()
            time.sleep(interval)
    view = lambda: render_status(read_status(board), read_state(run_dir))  # type: ignore[arg-type]  # noqa: E731
    with Live(view(), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(view(), refresh=True)


def _emit(st: BoardStatus, state: dict | None, json_out: bool) -> None:
    if json_out:
        sys.stdout.write(json.dumps({**st.to_dict(), "controller": state}, indent=2, default=str) + "\n")
    else:
        Console().print(render_status(st, state))


@app.command("restore")
def restore(root: Optional[Path] = typer.Option(None, "--root", help="Root of the board's file tree (default: "
                                                "the root recorded in the journal)."),
            run_dir: Path = run_dir_option("Where the agent keeps its restore journal.")) -> None:
    """Put back every clock/fan file the agent changed, from the journal in the run directory."""
    with cli_errors():
        found = read_journal(run_dir) if root is None else None
        where = _check_root(root) if root is not None else (found[0] if found else "/")
        with BoardLock(where, "orin-agent power restore"):  # never beside the board's owner
            report = restore_run_dir(run_dir, where)
            clear_state(run_dir)
        if not report.restored:
            typer.echo(f"nothing to restore (no journal in {run_dir})")
        else:
            typer.echo(f"restored {len(report.restored)} file(s) under {where}")


profiles.register(app)  # profiles, show, set, state on the same sub-app


def register(root_app: typer.Typer) -> None:
    root_app.add_typer(app, name="power")
