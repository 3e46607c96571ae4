"""`orin-agent power profiles | show | set | state`: the power profiles (power.policy.profiles) and the
controller's state. Thin: every value comes from ``power``; registered on the ``power`` sub-app by
``register(power_app)`` (agent/cli/power.py calls it).

``set`` without a running service applies the profile's power mode and its idle clocks directly,
journaled (``orin-agent power restore`` undoes it). The service has no API to switch profiles yet,
so ``set`` never talks to a running service; restart the service with the profile in its config.
"""
from __future__ import annotations

from pathlib import Path

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from agent.cli.common import cli_errors, print_json, profile_dir_option, root_option, run_dir_option
from power.policy.profiles import ProfileStore


def _store(profile_dir: Path) -> ProfileStore:
    return ProfileStore(str(profile_dir))


def profiles(profile_dir: Path = profile_dir_option(),
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
            print_json(rows)
            return
        t = Table(title="power profiles")
        for col in ("name", "nvpmodel", "description", "file"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["name"], r["nvpmodel"] or "-", r["description"], r["file"])
        Console().print(t)


def show(name: str = typer.Argument(..., help="Profile name."),
         profile_dir: Path = profile_dir_option(),
         json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The merged profile (includes resolved), with the files it came from."""
    with cli_errors():
        doc = _store(profile_dir).load(name).to_dict()
        if json_out:
            print_json(doc)
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
                root: Path = root_option(),
                run_dir: Path = run_dir_option(),
                profile_dir: Path = profile_dir_option(),
                dry_run: bool = typer.Option(False, "--dry-run", help="Print the writes, change nothing."),
                allow_reboot_modes: bool = typer.Option(
                    False, "--allow-reboot-modes",
                    help="Also switch to a power mode that changes the GPU TPC mask (needs a reboot)."),
                power_cap: Optional[float] = typer.Option(
                    None, "--power-cap", help="Power budget, W (over the watts of the profile's budget section); "
                    "recorded for the controller."),
                json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Apply a profile's power mode and idle clocks now (journaled; `power restore` undoes it).
    What the board does not offer (no nvpmodel.conf, no debugfs, no such mode) is skipped with one
    warning line."""
    from power.runtime.session import apply_profile
    from power.hw.rootlock import BoardLock

    with cli_errors():
        if not root.is_dir():
            raise FileNotFoundError(f"--root {root}: no such directory")
        # the board's one owner while it writes (a dry run writes nothing and takes no lock)
        lock = None if dry_run else BoardLock(root, f"orin-agent power set {name}")
        try:
            done = apply_profile(root, run_dir, name, profile_dir=profile_dir, dry_run=dry_run,
                                 echo=None if json_out else typer.echo, allow_reboot_modes=allow_reboot_modes,
                                 power_cap_w=power_cap)
        finally:
            if lock is not None:
                lock.close()
        if json_out:
            d = done.decision
            print_json({"profile": done.profile.name, "root": str(root), "dry_run": dry_run,
                        "decision": {"gpu_min_hz": d.gpu_min_hz, "gpu_max_hz": d.gpu_max_hz, "emc_hz": d.emc_hz,
                                     "cpu_max_khz": d.cpu_max_khz, "reason": d.reason},
                        "warning": "; ".join(done.warnings) or None, "warnings": list(done.warnings),
                        "budget": None if done.profile.budget is None else {
                            "watts": done.profile.budget.watts, "window_s": done.profile.budget.window_s}})
            return
        if done.warnings:
            typer.echo("warning: " + "; ".join(done.warnings), err=True)
        if not dry_run:
            typer.echo(f"profile {done.profile.name} applied to {root} (idle clocks; `orin-agent power restore` "
                       f"undoes it)")
            if done.profile.budget is not None:
                b = done.profile.budget
                typer.echo(f"power budget {b.watts:g} W over {b.window_s:g} s: held by the controller while it "
                           f"runs (`orin-agent serve --power-cap` or the profile's [budget])")


def state(run_dir: Path = run_dir_option("The controller's run directory."),
          json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The power controller's active profile, phase and last decision (from its state file)."""
    from power.runtime.state import describe_state, read_state

    with cli_errors():
        st = read_state(run_dir)
        if st is None:
            typer.echo(f"no power controller state in {run_dir} (no service running, no `power set`)")
            return
        if json_out:
            print_json(st)
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
