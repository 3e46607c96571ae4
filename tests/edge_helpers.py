"""Starting the deep slice on REAL Triton Inference Server for the offload tests: the edge interpreter
that scripts/edge-venv.sh builds, or a skip that says how to get it (and a skip with the server's own
last words where tritonserver cannot start on this machine)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from partition.offload.launch import DEFAULT_EDGE_PYTHON, EdgeOptions, EdgeServer, EdgeUnavailable
from partition.paths import DEFAULT_MODEL_DIR


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
        pytest.skip(f"tritonserver could not start here: {str(exc)[-400:]}")
    return server
