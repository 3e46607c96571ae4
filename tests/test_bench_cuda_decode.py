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


def test_compare_tokens_sets_each_row_beside_the_first_and_its_weights_twin() -> None:
    """Greedy tokens: every row against the first (a bf16 row, which INT4 rows differ from anyway) and against the
    first earlier row of the same weights, so that a formulation claiming the default's values (-ropeattn, -mergeo)
    shows whether it kept them; gpt-fast's rows (no variant of the script) get only the first comparison; tokens are
    dropped from the rows."""
    rows = [{"variant": "graphs-compile", "tokens": [1, 2, 3, 4]},
            {"variant": "int4-fused-lmhead", "tokens": [1, 2, 9, 9]},
            {"variant": "int4-fused-lmhead-ropeattn", "tokens": [1, 2, 9, 9]},
            {"variant": "int4-fused-lmhead-mergeo", "tokens": [1, 2, 9, 7]},
            {"variant": "int4-fused-g32-ropeattn", "tokens": [5, 5, 5, 5]},
            {"variant": "gpt-fast-int4", "tokens": [1, 2, 3, 4]}]
    bcd.compare_tokens(rows)
    assert all("tokens" not in r for r in rows)
    first, int4, rope, merge, g32, gpt = rows
    assert first["tokens_match_graphs-compile"] and "same_weights_as" not in first
    assert not int4["tokens_match_graphs-compile"] and int4["first_token_diff_step"] == 2 and "same_weights_as" not in int4
    assert rope["same_weights_as"] == "int4-fused-lmhead" and rope["tokens_match_same_weights"]
    assert rope["first_token_diff_same_weights"] is None
    assert merge["same_weights_as"] == "int4-fused-lmhead" and not merge["tokens_match_same_weights"]
    assert merge["first_token_diff_same_weights"] == 3
    assert "same_weights_as" not in g32  # group 32: other weights
    assert gpt["tokens_match_graphs-compile"] and "same_weights_as" not in gpt
