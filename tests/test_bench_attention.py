"""scripts/bench_attention.py compares like with like: its GroupQueryAttention and CacheAttention sessions give the
same outputs on the same caches, and its model-level A/B builds the native graph with each attention."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import ort_q4
from script_loader import load_script

pytestmark = pytest.mark.skipif(ort_q4.library() is None, reason=f"the operator did not build: {ort_q4.unavailable()}")


def _script():
    return load_script("bench_attention")


def test_the_two_layer_sessions_compute_the_same_attention() -> None:
    ba = _script()
    heads, kv_heads, hd = ba.SHAPES["smollm2"]
    outs = []
    for op in ("gqa", "native"):
        sess, binding = ba.layer_session(op, heads, kv_heads, hd, 16, str(ort_q4.library()))
        sess.run_with_iobinding(binding)
        outs.append(binding.copy_outputs_to_cpu())
    names = [o.name for o in sess.get_outputs()]
    for i in range(ba.LAYERS):
        j = names.index(f"out_{i}")
        assert outs[0][j].shape == (1, 1, heads * hd)
        np.testing.assert_allclose(outs[1][j], outs[0][j], rtol=0, atol=2e-6 * np.abs(outs[0][j]).max())
    rows = ba.per_layer(1, [8], [1], str(ort_q4.library()))
    assert [(r["shape"], r["slots"], r["threads"]) for r in rows] == [(s, 8, 1) for s in ba.SHAPES]
    assert all(r["gqa_us"] > 0 and r["native_us"] > 0 for r in rows)


def test_model_level_builds_each_attention(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # (test_gguf_synthetic's writer imports it)
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QT
    from test_gguf_synthetic import _config, write_gguf

    path = tmp_path / "tiny.gguf"
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_gguf(path, "llama", _config("llama", True), True, types={k: QT.Q4_0 for k in kinds})
    res = _script().model_level(path, rounds=1, steps=2, threads=1)
    assert {"native", "native, GroupQueryAttention"} <= set(res)
    assert all(res[n]["step_ms"] > 0 for n in ("native", "native, GroupQueryAttention"))
