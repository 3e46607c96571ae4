"""scripts/bench_cuda_decode.py's pure parts (the GPU runs themselves are the device's)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_cuda_decode as bcd  # noqa: E402


def test_kernels_by_launch_parts_one_kernel_by_its_grid() -> None:
    """The profile's per-launch table: the INT4 GEMV's launches on two weights (two grids) are two rows, each with its
    own time a step, launches a step and time a launch; non-kernel events (CPU ops, memcpys) are left out; the rows
    come by time; older kineto's "Kernel" category counts too."""
    gemv = "_gemv_reduced_kernel"
    events = [
        *({"cat": "kernel", "name": gemv, "dur": 24.0, "args": {"grid": [1, 56, 16], "block": [128, 1, 1]}}
          for _ in range(4)),  # gate/up: 2 layers x 2 steps
        *({"cat": "kernel", "name": gemv, "dur": 6.0, "args": {"grid": [1, 8, 32], "block": [128, 1, 1]}}
          for _ in range(4)),  # o
        {"cat": "Kernel", "name": "_merge_kernel", "dur": 1.5, "args": {"grid": [32, 1, 1], "block": [128, 1, 1]}},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 500.0, "args": {}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 90.0, "args": {}},
    ]
    rows = bcd.kernels_by_launch({"traceEvents": events}, steps=2)
    assert [(r["name"], r["grid"]) for r in rows] == [(gemv, [1, 56, 16]), (gemv, [1, 8, 32]),
                                                     ("_merge_kernel", [32, 1, 1])]
    assert rows[0] == {"name": gemv, "grid": [1, 56, 16], "block": [128, 1, 1], "us_per_step": 48.0,
                       "calls_per_step": 2.0, "us_per_call": 24.0}
    assert rows[1]["us_per_step"] == 12.0 and rows[2]["calls_per_step"] == 0.5
    assert len(bcd.kernels_by_launch({"traceEvents": events}, steps=2, top=1)) == 1
    assert bcd.kernels_by_launch({}, steps=1) == []
