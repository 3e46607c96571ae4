"""scripts/bench_peer.py's "same threads": on the CPU every child (llama.cpp's and the project's) runs pinned to the
first --threads CPUs of the script's own affinity, and a --threads the machine cannot give is a one-line error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_peer.py"


@pytest.mark.parametrize("threads", ["0", "4096"])
def test_threads_beyond_the_machine_is_a_clear_error(threads: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--threads", threads], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"--threads {threads}: this process may use" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_children_run_on_the_pinned_cpus() -> None:
    """run_child with CPUS set: the child's affinity is exactly those CPUs (run in a fresh interpreter: importing
    the script swaps subprocess.Popen for its RSS-keeping subclass)."""
    first = sorted(os.sched_getaffinity(0))[0]
    code = (f"import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('bp', {str(SCRIPT)!r}); "
            "bp = importlib.util.module_from_spec(spec); spec.loader.exec_module(bp); "
            f"bp.CPUS = bp.pinned_cpus(1, [{first}]); "
            "rc, out, err, rss = bp.run_child([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))']); "
            "print(json.dumps({'rc': rc, 'out': out.strip(), 'rss': rss}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["out"] == f"[{first}]" and got["rss"] > 0
