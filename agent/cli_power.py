"""`orin-agent power ...`: board status and restore."""
from __future__ import annotations

import typer

app = typer.Typer(help="Read the board's clocks, temperatures and power; restore what the agent changed.",
                  no_args_is_help=True)
