"""What every CLI command shares: turning the packages' own errors into a one-line message and an exit
code (never a traceback), and printing JSON for scripts."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import typer


@contextmanager
def cli_errors() -> Iterator[None]:
    """Our error types are ValueError / OSError subclasses whose messages say what was wrong and what to
    do: print that and exit 2. Anything else is a bug and keeps its traceback."""
    try:
        yield
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
