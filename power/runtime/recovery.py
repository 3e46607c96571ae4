"""The restore journal around a process's life on a board: on start, before anything else, put back what a
crashed previous run left changed; on stop, put back what this run changed (``orin-agent power restore``
makes the same call). Both through power.hw.journal; the board's one owner (power.hw.rootlock) is held by
the caller."""
from __future__ import annotations

import logging
import os

from power.hw.journal import Journal, restore_run_dir

log = logging.getLogger("orin_agent.board")


def recover_board(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> int:
    """On start: restore a crashed run's journal under ``run_dir``. Returns the number of files restored."""
    journal = Journal(run_dir, root, recover=False)
    try:
        if journal.stale_temps:
            log.warning("removed %d temp file(s) a killed write left: %s", len(journal.stale_temps),
                        ", ".join(journal.stale_temps))
        n = len(journal.entries)
        if n:
            log.warning("a previous run left %d board file(s) changed (journal in %s): restoring them first",
                        n, run_dir)
            journal.restore()
        return n
    finally:
        journal.close()


def restore_board(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> int:
    """On stop: put back every file this run's journal holds. Returns the number of files restored."""
    return len(restore_run_dir(run_dir, root).restored)
