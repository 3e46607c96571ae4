"""What every CLI command shares: turning the packages' own errors into a one-line message and an exit
code (never a traceback), printing JSON for scripts, and the board options (``--root``, ``--run-dir``,
``--profile-dir``) whose defaults are power.runtime.session's constants."""
from __future__ import annotations

import errno
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer


# Exit statuses: 2 is a usage or configuration error (systemd/orin-agent.service's
# RestartPreventExitStatus=2: retrying cannot fix it); 75 is a temporary failure that can pass, such as
# a full disk (EX_TEMPFAIL in BSD's sysexits.h: "the user is invited to retry"), which the unit's
# Restart=on-failure retries.
EXIT_USAGE, EXIT_TEMPFAIL = 2, 75
TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_transient(exc: BaseException) -> bool:
    """A full disk (or quota) anywhere in the error's chain of causes."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def cli_errors() -> Iterator[None]:
    """Our error types are ValueError / OSError subclasses whose messages say what was wrong and what to
    do: print that and exit 2 (75 when it can pass by itself: a full disk). Anything else is a bug and
    keeps its traceback."""
    try:
        yield
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_TEMPFAIL if is_transient(exc) else EXIT_USAGE) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


ROOT_HELP = "Root of the board's file tree: '/' on an Orin, a twin folder elsewhere."
RUN_DIR_HELP = "Where the restore journal and the power controller's state live."
PROFILE_DIR_HELP = "User profile folder (its profiles add to and override the shipped ones)."


def root_option(help: str = ROOT_HELP) -> Any:
    """``--root``: the board's file tree (default ``/``)."""
    from power.runtime.session import DEFAULT_ROOT  # here, not above: `generate` needs no power stack

    return typer.Option(Path(DEFAULT_ROOT), "--root", help=help)


def run_dir_option(help: str = RUN_DIR_HELP) -> Any:
    """``--run-dir``: the restore journal and the controller's state file (default /run/orin-agent)."""
    from power.runtime.session import DEFAULT_RUN_DIR

    return typer.Option(Path(DEFAULT_RUN_DIR), "--run-dir", help=help)


def profile_dir_option(help: str = PROFILE_DIR_HELP) -> Any:
    """``--profile-dir``: the user's power profiles (default /etc/orin-agent/profiles)."""
    from power.runtime.session import DEFAULT_PROFILE_DIR

    return typer.Option(Path(DEFAULT_PROFILE_DIR), "--profile-dir", help=help)
