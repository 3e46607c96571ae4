"""Starting the deep slice on REAL Triton Inference Server for the offload tests: the edge interpreter
that scripts/edge-venv.sh builds, or a skip that says how to get it (and a skip with the server's own
last words where tritonserver cannot start on this machine, but a failure, not a skip, where those last words are a
traceback through this project's own code: that is a defect of the code, not of the machine)."""
from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from partition.offload.launch import DEFAULT_EDGE_PYTHON, EdgeOptions, EdgeServer, EdgeUnavailable
from partition.paths import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


def traceback_in_project(text: str) -> bool:
    """Whether a log holds a Python traceback with a frame in this repository's files."""
    if "Traceback (most recent call last)" not in text:
        return False
    return any(Path(p).resolve().is_relative_to(ROOT) for p in re.findall(r'File "([^"<>]+\.py)"', text))


def start_edge(tmp: Path, cap: int = 6, **kw: object) -> EdgeServer:
    """The shipped model's layers 1: on a fresh tritonserver (max_seq 256, `cap` sequences), ready."""
    if not DEFAULT_EDGE_PYTHON.exists():
        pytest.skip(f"no edge Python at {DEFAULT_EDGE_PYTHON}: `bash scripts/edge-venv.sh` builds it "
                    "(torch CPU, numpy<2, nvidia-pytriton)")
    server = EdgeServer(EdgeOptions(DEFAULT_MODEL_DIR, 1, max_seq=256, cap=cap, **kw), tmp / "edge.log")  # type: ignore[arg-type]
    try:
        server.start().wait_ready(120)
    except EdgeUnavailable as exc:
        server.kill(signal.SIGKILL)
        if traceback_in_project(str(exc)):  # e.g. an import of the project's modules that fails in the edge's Python
            pytest.fail(f"the edge server failed in this project's code:\n{str(exc)[-2000:]}")
        pytest.skip(f"tritonserver could not start here: {str(exc)[-400:]}")
    return server
