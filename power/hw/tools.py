"""Thin wrappers for NVIDIA's command-line tools (nvpmodel, jetson_clocks): timeouts, clear errors.

They are run only when the root is the machine's own ``/`` (the callers check); under any other
root their effect is emulated on the tree's files or reported unavailable.
"""
from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

from power.hw.errors import ToolError

# nvpmodel -q answers at once; a mode switch can take a few seconds on a loaded board.
DEFAULT_TIMEOUT_S = 30.0

Runner = Callable[[Sequence[str], float], str]


def run_tool(args: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Run a tool without a terminal (stdin closed, so a reboot prompt cannot hang us); stdout text."""
    cmd = " ".join(args)
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
