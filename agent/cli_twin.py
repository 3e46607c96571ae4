"""`orin-agent twin ...`: create and run the simulated Orin."""
from __future__ import annotations

import typer

app = typer.Typer(help="The simulated Orin: lay out a board's sysfs tree in a folder and run its model.",
                  no_args_is_help=True)
