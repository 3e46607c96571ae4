"""Triton's CPU interpreter for the kernel tests. TRITON_INTERPRET=1 is read when a kernel is defined, so each
check runs in a fresh Python. A test names its checks with the `interpreter` marker, one code snippet a
process, and its body calls `run_marked(request)`:

    @pytest.mark.interpreter("from tests.test_x import check_a; check_a('cpu')", "...", timeout=300)
    def test_x_in_triton_interpreter(request): run_marked(request)

Once the session has collected its tests (conftest's pytest_collection_finish calls `start`), every marked
check of the selected tests starts in the background at the lowest CPU priority (nice 19), as many at a time
as the machine has cores. Each interpreter is one core of busy Python (~330 CPU-seconds in all on this
project's 2-core machines), and much of the suite leaves a core idle (processes starting, servers and signals
waited for), so the checks run under the rest of the suite instead of after it; at nice 19 they take
only what the suite leaves. The test then waits for its own checks and asserts each one's exit status, as a
plain run would."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as ResultTimeout  # not the builtin before Python 3.11
from typing import Any

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
PROBE_FAILED = 77  # a check's exit status when the interpreter itself cannot run a loop (test_kv_triton's probe)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_pool: ThreadPoolExecutor | None = None
_jobs: dict[str, Future] = {}
_procs: list[subprocess.Popen] = []
_lock = threading.Lock()


def _run(code: str, nice: bool) -> tuple[int, str]:
    probe = (f"import sys; from tests.test_kv_triton import interpreter_runs_loops; "
             f"interpreter_runs_loops() or sys.exit({PROBE_FAILED}); ")
    # the test modules import their helpers as pytest puts them on the path: tests/ itself
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    p = subprocess.Popen([sys.executable, "-c", ("import os; os.nice(19); " if nice else "") + probe + code],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with _lock:
        _procs.append(p)
    _, err = p.communicate()
    return p.returncode, err


def _submit(code: str, nice: bool) -> Future:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="interpreter")
        if code not in _jobs:
            _jobs[code] = _pool.submit(_run, code, nice)
        return _jobs[code]


def start(items: list[pytest.Item]) -> None:
    """Start every `interpreter` check of `items` in the background, in collection order."""
    if not HAS_TRITON:
        return
    for item in items:
        for mark in item.iter_markers("interpreter"):
            for code in mark.args:
                _submit(code, nice=True)


def stop() -> None:
    """Kill what is still running (a session cut short) and forget every result."""
    with _lock:
        for p in _procs:
            if p.poll() is None:
                p.kill()
        _procs.clear()
        _jobs.clear()


def run_in_interpreter(*codes: str, timeout: int) -> None:
    """Each of `codes` in its own interpreter process (started now unless `start` started it): wait up to
    `timeout` s for each; skip with the reason where this Triton's interpreter cannot run the kernels."""
    results: list[tuple[str, int, str]] = []
    for code in codes:
        fut = _submit(code, nice=False)
        try:
            rc, err = fut.result(timeout=timeout)
        except ResultTimeout:
            stop()
            raise AssertionError(f"{code}: no result within {timeout} s") from None
        results.append((code, rc, err))
    if any(rc == PROBE_FAILED for _, rc, _ in results):
        pytest.skip("this Triton's interpreter cannot run a loop up to a runtime bound with this numpy "
                    "(triton-lang/triton#9171); the cuda tests run the compiled kernels instead")
    for code, rc, err in results:
        assert rc == 0, f"{code}:\n{err[-3000:]}"


def run_marked(request: Any) -> None:
    """The checks of the calling test's `interpreter` marker (its args; its `timeout` kwarg, default 600 s)."""
    mark = request.node.get_closest_marker("interpreter")
    run_in_interpreter(*mark.args, timeout=int(mark.kwargs.get("timeout", 600)))
