"""`orin-agent smoke`: whether everything works on this board (or twin), one named check at a time,
as a table for people or ``--json`` for scripts; exit 0 only when no check failed. Thin: the checks
are agent.smoke's; this file parses options and prints."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent.cli.common import cli_errors, print_json
from agent.cli.options import BoardOptions, options, shared_options

_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


@shared_options
def smoke(board_opts: BoardOptions = options(BoardOptions, root="/", notes={
              "config": "Read for the model, the profile and the [smoke] minimums.",
              "run_dir": "Default: the service's, /run/orin-agent on a board, ROOT/run/orin-agent on a twin."}),
          build_dir: Optional[Path] = typer.Option(None, "--build-dir", help="An `orin-agent build` folder to "
                                                   "check against its manifest (skipped without one)."),
          service_url: Optional[str] = typer.Option(None, "--service-url", help="A running service to ask "
                                                    "/ready (default on a board: the config's host:port)."),
          quick: bool = typer.Option(False, "--quick", help="Fewer tokens, no engine loading."),
          as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Check the board (or twin) and the stack on it, in order; exit 0 only when nothing failed."""
    from agent.config import load_config
    from agent.smoke import CheckResult, SmokeOptions, default_run_dir, run_smoke
    from power.hw import sysfs

    root = Path(board_opts.root if board_opts.root is not None else "/")
    run_dir, config = board_opts.run_dir, board_opts.config
    with cli_errors():
        if not root.is_dir():
            raise FileNotFoundError(f"--root {root}: no such directory (the board's / or a twin folder: "
                                    "orin-agent twin create DIR)")
        cfg = load_config(config).with_model_folder()  # [model] dir may name a .gguf file or an alias
        url = service_url
        if url is None and sysfs.root_is_host(root):
            host = cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
            url = f"http://{host}:{cfg.port}"
        opts = SmokeOptions(str(root), str(run_dir) if run_dir else default_run_dir(root), cfg, quick=quick,
                            build_dir=build_dir, service_url=url, max_tokens=8 if quick else 24)
        console = Console(stderr=True)

        def show(r: CheckResult) -> None:  # each result as it lands
            if not as_json:
                console.print(f"[{_STYLE[r.status]}]{r.status:>4}[/] {r.title} ({r.seconds:.2f} s)")

        report = run_smoke(opts, show)
    if as_json:
        print_json(report.to_json())
    else:
        table = Table(title=f"orin-agent smoke on {root}{' (twin: simulated board)' if report.twin else ''}",
                      show_lines=False)
        for col in ("check", "status", "s", "detail / remedy"):
            table.add_column(col, justify="right" if col == "s" else "left", overflow="fold")
        for r in report.results:
            text = escape(r.detail) + (f"\n[bold]fix:[/] {escape(r.remedy)}" if r.remedy else "")
            table.add_row(r.title, f"[{_STYLE[r.status]}]{r.status}[/]", f"{r.seconds:.2f}", text)
        Console().print(table)
        n_fail = sum(r.status == "fail" for r in report.results)
        typer.echo(f"{'OK' if report.ok else f'{n_fail} check(s) failed'} in {report.seconds:.1f} s")
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("smoke")(smoke)
