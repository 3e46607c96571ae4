"""One end-to-end benchmark from start to finish: the root chosen (the board, a given twin, or a fresh
twin made here and removed afterwards), the trace run per profile, the report written."""
from __future__ import annotations

import os
from pathlib import Path

from agent.benchmark.report import write_report
from agent.benchmark.run import BenchMeta, BenchOptions, default_out_dir, fresh_twin, remove_twin, run_bench
from agent.config import ServiceConfig
from agent.smoke.context import default_run_dir, is_twin
from power.hw.identity import read_identity
from power.hw.rootlock import BoardLock


def run_end_to_end(root: str | os.PathLike[str] | None, run_dir: str | os.PathLike[str] | None,
                   config: ServiceConfig, trace: str, profiles: tuple[str, ...], out: Path | None,
                   profile_dir: str | None = None, plots: bool = True) -> tuple[Path, dict[str, object]]:
    """Benchmark ``config`` on ``root`` (None: a fresh twin); returns the output folder and the report."""
    made = None
    if root is None:
        r, rd, made = fresh_twin()
    else:
        if not Path(root).is_dir():
            raise FileNotFoundError(f"--root {root}: no such directory")
        r, rd = os.fspath(root), os.fspath(run_dir) if run_dir else default_run_dir(root)
    lock = None
    try:
        lock = BoardLock(r, "orin-agent bench run")  # the board's one owner while the profiles run
        twin = is_twin(r)
        ident = read_identity(r)
        opts = BenchOptions(r, os.fspath(run_dir) if run_dir and made is None else rd, config, trace,
                            profiles, profile_dir, twin)
        runs = run_bench(opts)
        meta = BenchMeta(r if made is None else "(a fresh twin, removed)", twin,
                         (ident.board or ident.model or "unknown board") + (" twin" if twin else ""),
                         config.model_dir.name, config.backend, config.device, trace, profiles)
        dest = out or default_out_dir(trace)
        return dest, write_report(meta, runs, dest, plots)
    finally:
        if lock is not None:
            lock.close()
        if made is not None:
            remove_twin(made)
