"""`orin-agent power profiles | show | set | state`: the power profiles (power.policy.profiles) and the
controller's state. Thin: every value comes from ``power``; registered on the ``power`` sub-app by
``register(power_app)`` (agent/cli/power.py calls it).

``set`` without a running service applies the profile's power mode and its idle clocks directly,
journaled (``orin-agent power restore`` undoes it). The service has no API to switch profiles yet,
so ``set`` never talks to a running service; restart the service with the profile in its config.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agent.cli.common import cli_errors
from power.policy.profiles import DEFAULT_USER_DIR, ProfileStore

ROOT_HELP = "Root of the board's file tree: '/' on an Orin, a twin folder elsewhere."
DIR_HELP = "User profile folder (its profiles add to and override the shipped ones)."


def _store(profile_dir: Path) -> ProfileStore:
    return ProfileStore(str(profile_dir))


def profiles(profile_dir: Path = typer.Option(Path(DEFAULT_USER_DIR), "--profile-dir", help=DIR_HELP),
             json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the profiles: name, where it comes from, description."""
    with cli_errors():
        store = _store(profile_dir)
        rows = []
        for name, path in sorted(store.files().items()):
            p = store.load(name)
            rows.append({"name": name, "file": str(path), "description": p.description,
                         "nvpmodel": p.nvpmodel})
        if json_out:
            sys.stdout.write(json.dumps(rows, indent=2) + "\n")
            return
        t = Table(title="power profiles")
        for col in ("name", "nvpmodel", "description", "file"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["name"], r["nvpmodel"] or "-", r["description"], r["file"])
        Console().print(t)


def show(name: str = typer.Argument(..., help="Profile name."),
         profile_dir: Path = typer.Option(Path(DEFAULT_USER_DIR), "--profile-dir", help=DIR_HELP),
         json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The merged profile (includes resolved), with the files it came from."""
    with cli_errors():
        doc = _store(profile_dir).load(name).to_dict()
        if json_out:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            return
        c = Console()
        c.print(f"[bold]{doc['name']}[/bold]: {doc['description']}")
        c.print(f"from: {' <- '.join(doc['sources'])}")
        c.print(f"nvpmodel: {doc['nvpmodel'] or '(unchanged)'}")
        t = Table(title="clocks per phase")
        for col in ("phase", "gpu_min", "gpu_max", "emc", "cpu_max"):
            t.add_column(col)
        for ph in ("prefill", "decode", "idle"):
            t.add_row(ph, *(doc[ph][k] for k in ("gpu_min", "gpu_max", "emc", "cpu_max")))
        c.print(t)
        for sect in ("latency", "thermal", "fan", "timing"):
            c.print(f"{sect}: " + ", ".join(f"{k}={v}" for k, v in doc[sect].items()))


def set_profile(name: str = typer.Argument(..., help="Profile name."),
                root: Path = typer.Option(Path("/"), "--root", help=ROOT_HELP),
                run_dir: Path = typer.Option(Path("/run/orin-agent"), "--run-dir",
                                             help="Where the restore journal and controller state live."),
                profile_dir: Path = typer.Option(Path(DEFAULT_USER_DIR), "--profile-dir", help=DIR_HELP),
                dry_run: bool = typer.Option(False, "--dry-run", help="Print the writes, change nothing.")) -> None:
    """Apply a profile's power mode and idle clocks now (journaled; `power restore` undoes it)."""
    from power.applier import ClockApplier, tables_from_board
    from power.hw.backends import SysfsBoard, open_board
    from power.physics.boards import BOARDS
    from power.controller import write_state
    from power.policy.dvfs import DvfsController, PhaseIn, Readings, DvfsState

    with cli_errors():
        prof = _store(profile_dir).load(name)
        if not root.is_dir():
            raise FileNotFoundError(f"--root {root}: no such directory")
        board = open_board(root)
        writer = board.writer(run_dir, dry_run=dry_run, echo=typer.echo, recover=False)
        applier = ClockApplier(board, writer)
        try:
            if prof.nvpmodel:
                applier.set_mode(prof.nvpmodel)
                if not dry_run:
                    board = SysfsBoard(board.root)
                    applier.board = board
            spec = BOARDS.get(board.info.identity.board or "")
            tables = tables_from_board(board, spec.emc_hz if spec else ())
            d, _ = DvfsController(tables).decide(Readings(), PhaseIn("idle"), prof, DvfsState(), 0.0)
            applier.apply(d)
        finally:
            if writer.journal is not None:
                writer.journal.close()      # leave the journal for `power restore`
        if not dry_run:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_state(run_dir, {"profile": prof.name, "phase": "idle", "set_by": "orin-agent power set",
                                  "decision": {"gpu_min_hz": d.gpu_min_hz, "gpu_max_hz": d.gpu_max_hz,
                                               "emc_hz": d.emc_hz, "cpu_max_khz": d.cpu_max_khz,
                                               "reason": d.reason}})
            typer.echo(f"profile {prof.name} applied to {root} (idle clocks; `orin-agent power restore` undoes it)")


def state(run_dir: Path = typer.Option(Path("/run/orin-agent"), "--run-dir", help="The controller's run directory."),
          json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The power controller's active profile, phase and last decision (from its state file)."""
    from power.controller import describe_state, read_state

    with cli_errors():
        st = read_state(run_dir)
        if st is None:
            typer.echo(f"no power controller state in {run_dir} (no service running, no `power set`)")
            return
        if json_out:
            sys.stdout.write(json.dumps(st, indent=2) + "\n")
            return
        typer.echo(describe_state(st))
        if st.get("thermal"):
            th = st["thermal"]
            typer.echo(f"hottest {th.get('hottest')} {th.get('hottest_c')} °C, target {th.get('target_c')} °C, "
                       f"critical {th.get('critical_c')} °C, offline {th.get('offline')}")


def register(power_app: typer.Typer) -> None:
    power_app.command("profiles")(profiles)
    power_app.command("show")(show)
    power_app.command("set")(set_profile)
    power_app.command("state")(state)
