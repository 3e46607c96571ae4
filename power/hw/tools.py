"""NVIDIA's command-line tools (nvpmodel, jetson_clocks) behind one call signature, the ``Runner``.

The hardware classes (power.hw.nvpmodel, power.hw.jetson_clocks) always call a runner, the one whoever
opens the board passes in: on the board :func:`run_tool` runs the real tool (timeouts, clear errors,
nothing run in a dry run); on a twin tree the composition roots (power.runtime.board) pass
power.twin.runner.TwinRunner, which has the same effect on the tree's files through the caller's
journal. The hardware layer never picks the twin itself: a root that is not this machine's ``/`` opened
without a runner gets :class:`NoTools`, which refuses every call.
"""
from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from power.hw.errors import ToolError

if TYPE_CHECKING:
    from power.hw.writer import ClockWriter

# nvpmodel -q answers at once; a mode switch can take a few seconds on a loaded board.
DEFAULT_TIMEOUT_S = 30.0


class Runner(Protocol):
    """Run a tool; stdout text. ``writer``: given for the commands that change the board (a dry-run
    writer means: say what would run, change nothing)."""

    def __call__(self, args: Sequence[str], timeout_s: float, writer: ClockWriter | None = None) -> str: ...


def journals_writes(runner: Runner) -> bool:
    """Whether the runner's writes go through the caller's journal (the twin's do; the real tools'
    do not, so the caller records what it can put back before running them)."""
    return bool(getattr(runner, "journals_writes", False))


def run_tool(args: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, writer: ClockWriter | None = None) -> str:
    """Run a tool without a terminal (stdin closed, so a reboot prompt cannot hang us); stdout text."""
    cmd = " ".join(args)
    if writer is not None and writer.dry_run:
        if writer.echo:
            writer.echo(f"would run `{cmd}`")
        return ""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError as exc:
        raise ToolError(f"`{cmd}`: {args[0]} is not installed (is this a Jetson with JetPack?)") from exc
    except subprocess.TimeoutExpired as exc:
        raise ToolError(f"`{cmd}` did not finish within {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise ToolError(f"`{cmd}`: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise ToolError(f"`{cmd}` failed with exit code {proc.returncode}"
                        + (f": {detail[-1]}" if detail else ""))
    return proc.stdout


class NoTools:
    """The runner of a root that is not this machine's ``/`` when whoever opened it passed none: the real
    tools would act on the host, not on the tree, so every call is refused with what to do instead."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, args: Sequence[str], timeout_s: float, writer: ClockWriter | None = None) -> str:
        raise ToolError(f"`{' '.join(args)}` for {self.root}: NVIDIA's tools act on this machine's own /, not "
                        f"on this tree; open the board with the tree's runner (power.runtime.board.open_board_at)")
