"""scripts/bench_weight_only.py: the native operator's rows it reports are the project's kernel on the weight the
other kernels get (the same codes, the minimums in half precision as a GGUF keeps them), and --stream times a decode
step's projections at the shapes the decoder graph gives it."""
from __future__ import annotations


import numpy as np
import pytest

from kernels import ort_q4
from script_loader import load_script

pytestmark = pytest.mark.skipif(ort_q4.library() is None, reason=f"the operator did not build: {ort_q4.unavailable()}")


def _script():
    return load_script("bench_weight_only")


def test_native_rows_time_the_operator() -> None:
    bw = _script()
    ks = {name: (nb, make) for name, t, nb, make in bw.kernels_for(64, 128, [1], seed=3) if name == "native q4 fp32"}
    assert set(ks) == {"native q4 fp32"}
    nbytes, make = ks["native q4 fp32"]
    assert nbytes == 64 * 128 // 2 + 2 * (64 * 4 * 2)  # codes + half-precision scales and minimums
    make(np.ones((1, 128), np.float32))()  # runs


def test_stream_covers_a_decode_step() -> None:
    bw = _script()
    rows = bw.stream([1], rounds=1, layers=1, passes=1)
    assert len(rows) == 1 and rows[0].kernel == "native q4 fp32"
    n_weights = sum(n * k for n, k, _ in bw.STREAM_LAYER)
    assert rows[0].weight_bytes == n_weights // 2 + n_weights // 32 * 4
    assert rows[0].median_us > 0
