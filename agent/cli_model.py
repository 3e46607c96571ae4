"""`orin-agent generate` and `orin-agent build`."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
