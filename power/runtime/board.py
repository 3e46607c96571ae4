"""Opening a board at a root with the tools that act on it: the real nvpmodel / jetson_clocks on this
machine's own ``/``, the twin's runner (power.twin.runner.TwinRunner: their effect on the tree's files,
through the caller's journal) on any other root. The composition roots (the session, the CLIs, the
smoke checks, the benchmark) open boards here; the hardware layer below never picks the twin."""
from __future__ import annotations

import os

from power.hw import sysfs
from power.hw.backends import SysfsBoard, open_board
from power.hw.tools import Runner, run_tool


def default_runner(root: str | os.PathLike[str]) -> Runner:
    """The real tools on the machine's own ``/``; on any other root (a twin tree) the twin's runner."""
    if sysfs.root_is_host(root):
        return run_tool
    from power.twin.runner import TwinRunner    # only a twin root loads it (not the twin's model either)
    return TwinRunner(root)


def open_board_at(root: str | os.PathLike[str] = "/", *, backend: str = "auto") -> SysfsBoard:
    """power.hw.backends.open_board (the one backend factory) with :func:`default_runner`'s tools."""
    return open_board(root, backend=backend, runner=default_runner(root))


def rediscover(board: SysfsBoard) -> SysfsBoard:
    """The board found again under the same root with the same tools (after a mode switch changed its caps
    and cores online)."""
    return SysfsBoard(board.root, runner=board.runner)
