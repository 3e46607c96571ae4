"""scripts/bench_weight_only.py's opt-in C kernel (the exact Q4_1 x fp32 prototype its --c-kernel times against MLAS):
the numbers it reports are only worth citing if it computes y = x @ (d q + m)^T, so check it on shapes with more
than one 64-column step and more than one 4-row pass, one and several rows of x, one and two threads, and check
that the codes' order it reads (`lanes`) is the one it claims."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("bench_weight_only", ROOT / "scripts" / "bench_weight_only.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_weight_only", mod)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_lanes_order() -> None:
    bw = _script()
    q = np.arange(2 * 128).reshape(2, 128) % 16
    w = bw.lanes(q)
    assert w.shape == (2, 2, 8) and w.dtype == np.uint32
    for row in range(2):
        for col in range(128):
            step, within = divmod(col, 64)
            j, lane = divmod(within, 8)
            assert (int(w[row, step, lane]) >> (4 * j)) & 15 == q[row, col]


def test_c_kernel_is_the_q4_1_product() -> None:
    bw = _script()
    fn = bw.c_kernel()
    if fn is None:
        pytest.skip("needs gcc and an x86 CPU with AVX2 and FMA (the script says which is missing)")
    rng = np.random.default_rng(0)
    n, k = 44, 192
    q = rng.integers(0, 16, (n, k))
    d = rng.uniform(0.01, 0.05, (n, k // 32)).astype(np.float32)
    m = -rng.uniform(0, 0.4, (n, k // 32)).astype(np.float32)
    codes = bw.lanes(q)
    grp = np.arange(k) // 32
    w = q * d[:, grp].astype(np.float64) + m[:, grp]
    for rows, threads in ((1, 1), (3, 2)):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        y = np.empty((rows, n), np.float32)
        fn(x.ctypes.data, rows, k, n, codes.ctypes.data, d.ctypes.data, m.ctypes.data, y.ctypes.data, threads)
        want = x.astype(np.float64) @ w.T
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (rows, threads)
