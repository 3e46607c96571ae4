"""kernels/ort_q4.c, the exact 4-bit custom operator: its products against the dequantised weight in float64, its
thread team, its ONNX Runtime registration, and what it refuses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels import ort_q4

LIB = ort_q4.library()
needs_lib = pytest.mark.skipif(LIB is None, reason=f"the operator did not build here: {ort_q4.unavailable()}")


def weight(n: int, k: int, group: int, seed: int, zeros: bool = False, bits: int = 4):
    """Random codes, scales and minimums that are values of half precision (as GGUF's are), the packed weight and its
    dequantisation in float64. bits=8 with zeros: GGUF's Q8_0 (codes q + 128, zero point 128)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    s = (rng.random((n, k // group)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    if zeros:  # Q4_0's form: z = 8, Q8_0's: 128 (any zero point whose -z * scale is a value of half precision)
        z = np.full((n, k // group), 1 << (bits - 1))
        packed = ort_q4.pack(codes, s, zeros=z, bits=bits)
        m = -(z * s)
    else:
        m = (-s * rng.random((n, k // group)) * 15).astype(np.float16).astype(np.float32)
        packed = ort_q4.pack(codes, s, m, bits=bits)
    w = codes.astype(np.float64).reshape(n, k // group, group) * s[..., None] + m[..., None]
    return packed, w.reshape(n, k)


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


@needs_lib
@pytest.mark.parametrize("n,k,group,bits", [(1536, 576, 32, 4), (576, 1536, 32, 4), (192, 576, 64, 4),
                                            (64, 256, 128, 4), (576, 576, 32, 8), (128, 256, 64, 8)])
# 1-3: one row of x at a time; from 4: dequantise-once (AVX2: blocks of 16 rows where 8 or more are left, then pairs;
# 21 = 16 + 5, 40 = 16 + 16 + 8; NEON and plain C: pairs)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 21, 40])
def test_matmul_is_the_dequantised_product(n: int, k: int, group: int, bits: int, rows: int) -> None:
    packed, w = weight(n, k, group, seed=n + k + rows, zeros=bits == 8, bits=bits)
    assert packed.bits == bits
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.T
    for threads in (1, 2):
        ort_q4.set_threads(threads)
        got = ort_q4.matmul(x, packed)
        assert got.shape == (rows, n)
        # fp32 arithmetic over K products: within a few fp32 roundings of the largest output
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@needs_lib
@pytest.mark.parametrize("rows", [1, 5])
def test_glu_rows_give_silu_gate_times_up(rows: int) -> None:
    """glu: the gate rows then the up rows, reordered by glu_rows into tiles of 8; the output is silu(gate) * up.
    Zero points (Q4_0's form, minimum = -z * scale) take the same path."""
    inter, k = 96, 128
    packed, w = weight(2 * inter, k, 32, seed=7, zeros=True)
    order = ort_q4.glu_rows(inter)
    tiled = ort_q4.Q4Weight(packed.codes[order], packed.scales[order], packed.mins[order])
    x = np.random.default_rng(8).standard_normal((2, rows, k)).astype(np.float32)  # leading dims are rows too
    xd = x.astype(np.float64)
    want = silu(xd @ w[:inter].T) * (xd @ w[inter:].T)
    got = ort_q4.matmul(x, tiled, glu=True)
    assert got.shape == (2, rows, inter)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert sorted(order.tolist()) == list(range(2 * inter))
    assert order[:8].tolist() == [0, 1, 2, 3, inter, inter + 1, inter + 2, inter + 3]


@needs_lib
def test_results_do_not_depend_on_the_threads() -> None:
    """Each output is one thread's (threads take whole chunks of rows from a counter): the same bits at any team size,
    also when the team is resized between calls many times (a worker that missed a call would hang this test)."""
    packed, _ = weight(1024, 512, 32, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 512)).astype(np.float32)
    ort_q4.set_threads(1)
    first = ort_q4.matmul(x, packed)
    for i in range(60):
        ort_q4.set_threads(1 + i % 3)
        assert np.array_equal(ort_q4.matmul(x, packed), first)
    ort_q4.set_threads(2)


def test_pack_refuses_what_half_precision_would_round() -> None:
    codes = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="half precision"):
        ort_q4.pack(codes, np.full((4, 2), 0.1, np.float32), np.zeros((4, 2), np.float32))
    ort_q4.pack(codes, np.full((4, 2), 0.125, np.float32), np.zeros((4, 2), np.float32))  # a value of it


def test_fits_and_lanes() -> None:
    assert ort_q4.fits(8, 64, 32) and ort_q4.fits(8, 128, 64, glu=True)
    assert not ort_q4.fits(8, 96, 32)  # K not a multiple of 64
    assert not ort_q4.fits(6, 64, 32)  # N not a multiple of 4
    assert not ort_q4.fits(12, 64, 32, glu=True)  # glu: tiles of 8 rows
    assert not ort_q4.fits(8, 192, 96)  # groups of 32 times a power of two only
    codes = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    words = ort_q4.lanes(codes)
    assert words.shape == (1, 1, 8) and words.dtype == np.uint32
    for col in range(64):  # nibble j of word l is column 8 j + l
        assert (int(words[0, 0, col % 8]) >> (4 * (col // 8))) & 15 == codes[0, col]


@needs_lib
def test_matmul_refuses_a_shape_it_does_not_take() -> None:
    packed, _ = weight(8, 64, 32, seed=1)
    with pytest.raises(ValueError, match="not a shape"):
        ort_q4.matmul(np.zeros((1, 32), np.float32), packed)


def _session(packed: ort_q4.Q4Weight, k: int, n_out: int, glu: bool = False, scales=None):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(packed.codes, "c"),
             numpy_helper.from_array(packed.scales if scales is None else scales, "s"),
             numpy_helper.from_array(packed.mins, "m")]
    node = helper.make_node(ort_q4.OP, ["x", "c", "s", "m"], ["y"], domain=ort_q4.DOMAIN, **({"glu": 1} if glu else {}))
    graph = helper.make_graph([node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", n_out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ort_q4.DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(LIB))
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@needs_lib
def test_the_operator_in_onnx_runtime() -> None:
    """Registered from the built library, a Q4MatMul node computes what `matmul` does, for decode and prefill
    shapes, with and without glu."""
    packed, w = weight(256, 128, 32, seed=11)
    sess = _session(packed, 128, 256)
    for t in (1, 6):
        x = np.random.default_rng(t).standard_normal((1, t, 128)).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        assert np.array_equal(got, ort_q4.matmul(x, packed))
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=0, atol=2e-6 * np.abs(got).max())
    order = ort_q4.glu_rows(128)
    tiled = ort_q4.Q4Weight(packed.codes[order], packed.scales[order], packed.mins[order])
    x = np.random.default_rng(9).standard_normal((1, 1, 128)).astype(np.float32)
    got = _session(tiled, 128, 128, glu=True).run(None, {"x": x})[0]
    assert np.array_equal(got, ort_q4.matmul(x, tiled, glu=True))


@needs_lib
def test_inconsistent_inputs_give_nan_not_a_crash() -> None:
    """Scales whose group count does not divide K (only a hand-made graph could pass them): the node writes NaN, so
    the result cannot be mistaken for numbers."""
    packed, _ = weight(8, 128, 32, seed=2)
    wrong = np.ascontiguousarray(packed.scales[:, :3])  # 3 groups for K = 128
    got = _session(packed, 128, 8, scales=wrong).run(None, {"x": np.ones((1, 1, 128), np.float32)})[0]
    assert np.isnan(got).all()


def _attention_session(op: str, heads: int, kv_heads: int, hd: int, rot: int, library=None):
    """One attention node over (B, KV, S, hd) caches: onnxruntime's GroupQueryAttention as the decoder graph writes it
    (op "GroupQueryAttention"), or the operator's CacheAttention registered from `library` (default: the built one)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("qkv", f, ["B", "T", (heads + 2 * kv_heads) * hd]),
           helper.make_tensor_value_info("pk", f, ["B", kv_heads, "S", hd]),
           helper.make_tensor_value_info("pv", f, ["B", kv_heads, "S", hd]),
           helper.make_tensor_value_info("sl", TensorProto.INT32, ["B"]),
           helper.make_tensor_value_info("total", TensorProto.INT32, []),
           helper.make_tensor_value_info("cos", f, ["P", rot // 2]), helper.make_tensor_value_info("sin", f, ["P", rot // 2])]
    outs = [helper.make_tensor_value_info("o", f, None), helper.make_tensor_value_info("k", f, ["B", kv_heads, "S", hd]),
            helper.make_tensor_value_info("v", f, ["B", kv_heads, "S", hd])]
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": 1 / np.sqrt(hd)}
    if op == "GroupQueryAttention":
        node = helper.make_node(op, ["qkv", "", "", "pk", "pv", "sl", "total", "cos", "sin"], ["o", "k", "v"],
                                domain="com.microsoft", do_rotary=1, rotary_interleaved=0, **attrs)
    else:
        node = helper.make_node(ort_q4.ATTENTION_OP, ["qkv", "pk", "pv", "sl", "total", "cos", "sin"], ["o", "k", "v"],
                                domain=ort_q4.DOMAIN, **attrs)
    model = helper.make_model(helper.make_graph([node], "attention", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(node.domain, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if op != "GroupQueryAttention":
        so.register_custom_ops_library(str(library or LIB))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _attend(sess, qkv, k, v, seqlens, cos, sin, shared: bool = True):
    """(out, present K, present V) of one run, the presents bound to the pasts' buffers as the decoder binds them
    (shared), or left to onnxruntime to allocate."""
    import onnxruntime as ort

    b = sess.io_binding()
    pk, pv = ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)
    for name, a in (("qkv", qkv), ("sl", seqlens), ("total", np.array(seqlens.max() + 1, np.int32)), ("cos", cos),
                    ("sin", sin)):
        b.bind_cpu_input(name, a)
    b.bind_ortvalue_input("pk", pk)
    b.bind_ortvalue_input("pv", pv)
    b.bind_output("o")
    if shared:
        b.bind_ortvalue_output("k", pk)
        b.bind_ortvalue_output("v", pv)
        sess.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[0], k, v
    b.bind_output("k")
    b.bind_output("v")
    sess.run_with_iobinding(b)
    return tuple(b.copy_outputs_to_cpu())


def _rope_tables(positions: int, rot: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(positions), 1 / 10000 ** (np.arange(0, rot, 2) / rot))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# (B, T, each row's last position): prefill, decode, chunks, batches; and decode steps long enough that a KV group's
# slots are split in pieces across the team (orin_q4_attention: at least 4 blocks of 32 a piece)
ATTENTION_CASES = [(1, 17, [16]), (1, 1, [0]), (1, 1, [40]), (1, 5, [30]), (2, 1, [10, 50]), (2, 6, [5, 5]),
                   (3, 1, [63, 0, 7]), (1, 1, [300]), (1, 2, [390]), (2, 1, [200, 333])]
ATTENTION_SLOTS = 400


def _check_attention(library, heads: int, kv_heads: int, hd: int, rot: int, threads=(1, 2, 3)) -> None:
    gqa = _attention_session("GroupQueryAttention", heads, kv_heads, hd, rot)
    ours = _attention_session(ort_q4.ATTENTION_OP, heads, kv_heads, hd, rot, library)
    cos, sin = _rope_tables(ATTENTION_SLOTS, rot)
    rng = np.random.default_rng(heads * hd + rot)
    for b, t, ends in ATTENTION_CASES:
        k0, v0 = (rng.standard_normal((b, kv_heads, ATTENTION_SLOTS, hd)).astype(np.float32) for _ in range(2))
        qkv = rng.standard_normal((b, t, (heads + 2 * kv_heads) * hd)).astype(np.float32)
        seqlens = np.array(ends, np.int32)
        want, wk, wv = _attend(gqa, qkv, k0.copy(), v0.copy(), seqlens, cos, sin)
        for n in threads:
            ort_q4.set_threads(n)
            got, gk, gv = _attend(ours, qkv, k0.copy(), v0.copy(), seqlens, cos, sin)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
            for r, end in enumerate(ends):  # the slots a row may see: the same; past them, the cache untouched
                np.testing.assert_allclose(gk[r, :, :end + 1], wk[r, :, :end + 1], rtol=0, atol=1e-6)
                np.testing.assert_array_equal(gv[r, :, :end + 1], wv[r, :, :end + 1])
                np.testing.assert_array_equal(gk[r, :, end + 1:], k0[r, :, end + 1:])
                np.testing.assert_array_equal(gv[r, :, end + 1:], v0[r, :, end + 1:])


@needs_lib
@pytest.mark.parametrize("heads,kv_heads,hd,rot", [(6, 2, 64, 64), (9, 3, 64, 64), (4, 4, 32, 32), (8, 1, 48, 48),
                                                   (4, 2, 128, 128), (4, 2, 64, 32)])
def test_cache_attention_is_group_query_attention(heads: int, kv_heads: int, hd: int, rot: int) -> None:
    """CacheAttention against onnxruntime's GroupQueryAttention on the same inputs: prefill, decode, chunked prefill
    and batches whose rows stand at different positions; head sizes with and without the 64-wide loops, a partial
    rotary; 1 and 2 threads. The outputs agree to fp32 rounding and the caches hold the same new K/V."""
    _check_attention(LIB, heads, kv_heads, hd, rot)


@needs_lib
def test_cache_attention_with_presents_of_their_own() -> None:
    """Presents not bound to the pasts' buffers (the decoder always binds them; a hand-made session may not): each
    present is its past with the new K/V written in, as GroupQueryAttention's."""
    heads, kv_heads, hd = 4, 2, 64
    cos, sin = _rope_tables(80, hd)
    rng = np.random.default_rng(5)
    k0, v0 = (rng.standard_normal((1, kv_heads, 64, hd)).astype(np.float32) for _ in range(2))
    qkv = rng.standard_normal((1, 1, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    seqlens = np.array([20], np.int32)
    ours = _attention_session(ort_q4.ATTENTION_OP, heads, kv_heads, hd, hd)
    got, gk, gv = _attend(ours, qkv, k0.copy(), v0.copy(), seqlens, cos, sin, shared=False)
    want, wk, wv = _attend(ours, qkv, k0.copy(), v0.copy(), seqlens, cos, sin)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gk, wk)
    np.testing.assert_array_equal(gv, wv)
    assert not np.array_equal(gk, k0)


@needs_lib
def test_cache_attention_past_the_caches_gives_nan() -> None:
    """A position past the caches' slots (the runner grows them first; only a hand-made call could): NaN out, and no
    write outside the buffers."""
    heads, kv_heads, hd = 4, 2, 64
    cos, sin = _rope_tables(80, hd)
    k0 = np.zeros((1, kv_heads, 16, hd), np.float32)
    qkv = np.ones((1, 1, (heads + 2 * kv_heads) * hd), np.float32)
    sess = _attention_session(ort_q4.ATTENTION_OP, heads, kv_heads, hd, hd)
    got, gk, _ = _attend(sess, qkv, k0.copy(), k0.copy(), np.array([16], np.int32), cos, sin)
    assert np.isnan(got).all() and not gk.any()


def test_a_machine_without_a_compiler_gets_a_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ort_q4, "_compiler", lambda: None)
    assert ort_q4.library(tmp_path) is None
    assert "no C compiler" in ort_q4.unavailable(tmp_path)


def test_native_activations_without_the_library_is_a_clear_error(monkeypatch) -> None:
    import onnxruntime as ort

    from partition.runners.ort_decoder_runner import native_session
    from partition.runners.ort_runner import OrtOptions

    monkeypatch.setattr(ort_q4, "library", lambda cache_dir=None, log=None: None)
    monkeypatch.setattr(ort_q4, "unavailable", lambda cache_dir=None: "no C compiler (set CC, or install gcc)")
    with pytest.raises(RuntimeError, match="--activations split or fp32"):
        native_session(ort.SessionOptions(), OrtOptions(activations="native"))
    native_session(ort.SessionOptions(), OrtOptions(activations="auto"))  # auto: nothing registered, no error


@needs_lib
def test_a_forked_child_computes_without_the_parents_workers() -> None:
    """fork copies only the calling thread: a child that used the parent's team would wait forever for workers it
    does not have. It starts again on its own thread and gets the same numbers."""
    import os

    packed, _ = weight(256, 128, 32, seed=5)
    x = np.random.default_rng(6).standard_normal((1, 128)).astype(np.float32)
    ort_q4.set_threads(2)
    want = ort_q4.matmul(x, packed)
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether it got the parent's bits
        try:
            os._exit(0 if np.array_equal(ort_q4.matmul(x, packed), want) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _q4_1(w: np.ndarray, group: int = 32):
    """w (N, K) as GGUF's Q4_1 would hold it: codes, and a half-precision scale and minimum per group."""
    from partition.build.ort_decoder import QuantWeight

    n, k = w.shape
    b = w.reshape(n, k // group, group)
    lo, hi = b.min(-1), b.max(-1)
    s = np.maximum((hi - lo) / 15, 1e-3).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint((b - m[..., None]) / s[..., None]), 0, 15).astype(np.uint8).reshape(n, k)
    return QuantWeight(4, codes, s, None, m, group)


def _q8_0(w: np.ndarray, group: int = 32):
    """w (N, K) as GGUF's Q8_0 would hold it: codes q + 128 (zero point 128) and a half-precision scale per group."""
    from partition.build.ort_decoder import QuantWeight

    n, k = w.shape
    b = w.reshape(n, k // group, group)
    s = np.maximum(np.abs(b).max(-1) / 127, 1e-4).astype(np.float16).astype(np.float32)
    codes = (np.clip(np.rint(b / s[..., None]), -127, 127) + 128).astype(np.uint8).reshape(n, k)
    return QuantWeight(8, codes, s, np.full(s.shape, 128), None, group)


@needs_lib
@pytest.mark.parametrize("quant", [_q4_1, _q8_0])
def test_a_native_decoder_graph_matches_the_fp32_one(quant) -> None:
    """A small model's Q4_1 (or Q8_0) projections: the "native" graph (every projection one Q4MatMul node, gate/up
    with its activation inside, attention as CacheAttention) gives the fp32 graph's logits to fp32 rounding, on a prefill and a decode step; its
    session runs ONNX Runtime on one thread, and the runner reports the operator's team as its threads."""
    import dataclasses

    from partition.build.ort_decoder import ACCURACY_FP32, ACCURACY_NATIVE, build_decoder, weights_from_model
    from partition.checkpoint import random_model
    from partition.config import ModelConfig
    from partition.runners.base import default_threads
    from partition.runners.ort_decoder_runner import OrtDecoderRunner
    from partition.runners.ort_runner import OrtOptions

    cfg = ModelConfig("LlamaForCausalLM", 512, 128, 3, 4, 2, 32, 256, max_position_embeddings=256,
                      tie_word_embeddings=True)
    w = weights_from_model(random_model(cfg, seed=12).eval())
    names = ("q", "k", "v", "o", "gate", "up", "down")
    w.layers = [dataclasses.replace(lw, **{n: quant(getattr(lw, n)) for n in names}) for lw in w.layers]
    native = build_decoder(w, 256, ACCURACY_NATIVE)
    ops = [nd.op_type for nd in native.graph.node]
    # per layer q/k/v and gate/up (with its activation) as Q4MatMul; o and down (but the last layer's) with the
    # residual add and the next norm in one Q4MatMulSkipNorm
    assert ops.count(ort_q4.OP) == 2 * cfg.n_layers + 1 and ops.count("Q4MatMulSkipNorm") == 2 * cfg.n_layers - 1
    assert "Sigmoid" not in ops and "MatMulNBits" not in ops
    assert ops.count("SkipSimplifiedLayerNormalization") == 1  # the final norm, after the last position is sliced
    assert ops.count(ort_q4.ATTENTION_OP) == cfg.n_layers and "GroupQueryAttention" not in ops
    assert sum(1 for nd in native.graph.node if nd.op_type == ort_q4.OP and nd.attribute) == cfg.n_layers  # glu
    runners = [OrtDecoderRunner(native.SerializeToString(), cfg.n_layers, 64, options=OrtOptions(activations="native")),
               OrtDecoderRunner(build_decoder(w, 256, ACCURACY_FP32).SerializeToString(), cfg.n_layers, 64,
                                options=OrtOptions(activations="fp32"))]
    assert runners[0].session.get_session_options().intra_op_num_threads == 1
    assert runners[0].threads == default_threads()
    ids = np.random.default_rng(13).integers(0, 512, (1, 10)).astype(np.int32)
    for t, pos in ((slice(0, 9), np.arange(9)), (slice(9, 10), np.array([9]))):
        got, want = (r.run(ids[:, t], pos.astype(np.int32)[None]) for r in runners)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@needs_lib
@pytest.mark.parametrize("rows", [1, 2, 5])  # 5: the dequantise-once path, exact
def test_int8_form_is_the_product_with_x_rounded_per_64_columns(rows: int) -> None:
    """The candidates' form: the codes in byte order, x rounded to int8 per 64 columns (max |x| / 127) for the codes'
    term, the minimum's term on x's fp32 sums; equal to that in float64 (and from 4 rows of x, to the exact
    product)."""
    n, k, group = 256, 192, 64
    rng = np.random.default_rng(20 + rows)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    s = (rng.random((n, k // group)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    scaled = (codes.astype(np.float64).reshape(n, k // group, group) * s[..., None]).reshape(n, k)  # s q
    offset = np.repeat(-8.0 * s.astype(np.float64), group, axis=1)  # the minimum, -8 s (Q4_0's zero point)
    packed = ort_q4.pack(codes, s, zeros=np.full(s.shape, 8), int8=True)
    assert packed.int8 and not np.array_equal(packed.codes, ort_q4.pack(codes, s, zeros=np.full(s.shape, 8)).codes)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    blocks = x.reshape(rows, k // 64, 64).astype(np.float64)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    xq = (np.rint(blocks / scale) * scale).reshape(rows, k)
    xd = x.astype(np.float64)  # the minimum's term takes x's exact sums, the codes' term its rounding
    want = (xq if rows < 4 else xd) @ scaled.T + xd @ offset.T
    np.testing.assert_allclose(ort_q4.matmul(x, packed), want, rtol=0, atol=2e-5 * np.abs(want).max())


@needs_lib
def test_skip_norm_form_is_the_product_then_onnxruntimes_skip_rms_norm() -> None:
    """Q4MatMulSkipNorm: S = x W^T + skip and Y = S / sqrt(mean(S^2) + epsilon) * gamma, both outputs, against
    onnxruntime's own SkipSimplifiedLayerNormalization on the Q4MatMul node's output."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from kernels.matmul_nbits import MS_DOMAIN

    n, k = 128, 192
    packed, _ = weight(n, k, 32, seed=30)
    rng = np.random.default_rng(31)
    gamma = rng.standard_normal(n).astype(np.float32)
    inits = [numpy_helper.from_array(a, name) for a, name in
             ((packed.codes, "c"), (packed.scales, "s"), (packed.mins, "m"), (gamma, "g"))]
    f = TensorProto.FLOAT
    fused = [helper.make_node("Q4MatMulSkipNorm", ["x", "c", "s", "m", "skip", "g"], ["y", "sum"],
                              domain=ort_q4.DOMAIN, epsilon=1e-5)]
    plain = [helper.make_node(ort_q4.OP, ["x", "c", "s", "m"], ["p"], domain=ort_q4.DOMAIN),
             helper.make_node("SkipSimplifiedLayerNormalization", ["p", "skip", "g"], ["y", "", "", "sum"],
                              domain=MS_DOMAIN, epsilon=1e-5)]
    outs = []
    for nodes in (fused, plain):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, "T", k]),
                                               helper.make_tensor_value_info("skip", f, [1, "T", n])],
                                  [helper.make_tensor_value_info("y", f, [1, "T", n]),
                                   helper.make_tensor_value_info("sum", f, [1, "T", n])], inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ort_q4.DOMAIN, 1), helper.make_opsetid(MS_DOMAIN, 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 8
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(LIB))
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feed = outs[0][2] if outs else {"x": rng.standard_normal((1, 3, k)).astype(np.float32),
                                        "skip": rng.standard_normal((1, 3, n)).astype(np.float32)}
        outs.append((*sess.run(["y", "sum"], feed), feed))
    (y, s, _), (y_ref, s_ref, _) = outs
    np.testing.assert_array_equal(s, s_ref)  # the same product, the same add
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5 * np.abs(y_ref).max())


@needs_lib
def test_the_plain_c_loops_give_the_same_products(tmp_path) -> None:
    """The loops a CPU without AVX2 or NEON builds (and an AArch64 build's loops without a NEON form), here on x86
    with -DQ4_PORTABLE, against the AVX2 build: the decode, int8, glu and prefill paths."""
    import subprocess

    cc = ort_q4._compiler()
    so = tmp_path / "portable.so"
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-pthread", "-DQ4_PORTABLE", str(ort_q4.SOURCE), "-o", str(so),
                    "-lm"], check=True, capture_output=True)
    lib = ort_q4._cdll(so)
    lib.orin_q4_set_threads(2)
    packed, _ = weight(128, 192, 64, seed=40, zeros=True)
    q8, _ = weight(128, 192, 64, seed=43, zeros=True, bits=8)
    codes = np.random.default_rng(42).integers(0, 16, (128, 192)).astype(np.uint8)
    i8 = ort_q4.pack(codes, packed.scales.astype(np.float32), zeros=np.full((128, 3), 8), int8=True)
    order = ort_q4.glu_rows(64)
    tiled = ort_q4.Q4Weight(packed.codes[order], packed.scales[order], packed.mins[order])
    rng = np.random.default_rng(41)
    for rows in (1, 2, 6):
        x = rng.standard_normal((rows, 192)).astype(np.float32)
        for w, glu in ((packed, False), (i8, False), (tiled, True), (q8, False)):
            want = ort_q4.matmul(x, w, glu=glu)
            got = ort_q4.matmul(x, w, glu=glu, library_path=so)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want).max())))
    for heads, kv_heads, hd in ((9, 3, 64), (8, 1, 48)):  # CacheAttention: its 64-wide loops and the rest
        _check_attention(so, heads, kv_heads, hd, hd, threads=(2,))


def test_a_read_only_cache_gets_a_reason_not_an_error(tmp_path) -> None:
    """Under the unit's ProtectHome=read-only a home cache cannot be written: library() says so and returns None (auto
    then leaves native out), instead of failing the model's load."""
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: a path under a file cannot be made by anyone
            (tmp_path / "file").write_text("")
            ro = tmp_path / "file"
        assert ort_q4.library(ro / "native") is None
        assert "cannot write" in ort_q4.unavailable(ro / "native")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_the_service_builds_into_its_cache_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}/unit:{tmp_path}/other")
    assert ort_q4.default_dir() == tmp_path / "unit" / "native"
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ort_q4.default_dir() == tmp_path / "xdg" / "orin-agent" / "native"


def _cross_tools() -> tuple[str, str] | None:
    import shutil

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    return (cc, qemu) if cc and qemu else None


@pytest.mark.skipif(_cross_tools() is None or ort_q4._compiler() is None,
                    reason="no AArch64 cross compiler and qemu-user here (apt: gcc-aarch64-linux-gnu qemu-user)")
def test_the_neon_loops_under_emulation(tmp_path) -> None:
    """The NEON forms (an Orin's CPU; never run on one): tests/native/ort_q4_harness.c built for AArch64 (an
    A78AE's -march=armv8.2-a+fp16+dotprod) and run under qemu-user, against the dequantised product in float64 and
    against the host's build of the same harness: the 4-bit decode loop (groups 32-128, 1-3 rows, glu), the
    8-bit one, the prefill path, the int8 form, and CacheAttention (head sizes 64 and 48, decode, prefill, a batch)."""
    import struct
    import subprocess

    cc, qemu = _cross_tools()
    harness = Path(__file__).with_name("native") / "ort_q4_harness.c"
    arm, host = tmp_path / "harness-aarch64", tmp_path / "harness-host"
    subprocess.run([cc, "-O3", "-march=armv8.2-a+fp16+dotprod", "-static", "-pthread", str(harness), "-o", str(arm),
                    "-lm"], check=True, capture_output=True)
    subprocess.run([ort_q4._compiler(), "-O3", "-march=native", *ort_q4.ARCH_FLAGS, "-pthread", str(harness), "-o",
                    str(host), "-lm"], check=True, capture_output=True)
    cases, sizes, checks = [], [], []
    for n, k, group, rows, glu, bits in [(192, 256, 32, 1, False, 4), (128, 192, 64, 2, False, 4),
                                         (64, 256, 128, 3, False, 4), (128, 128, 32, 1, True, 4),
                                         (96, 128, 32, 5, False, 4), (128, 192, 64, 1, False, 8),
                                         (64, 128, 32, 6, False, 8), (64, 128, 32, 4, False, 8)]:
        packed, w = weight(n, k, group, seed=n + k + rows, zeros=bits == 8, bits=bits)
        if glu:
            packed = ort_q4.Q4Weight(packed.codes[ort_q4.glu_rows(n // 2)], packed.scales[ort_q4.glu_rows(n // 2)],
                                     packed.mins[ort_q4.glu_rows(n // 2)])
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        if glu:
            want = silu(want[:, : n // 2]) * want[:, n // 2:]
        cases.append(struct.pack("<9i", 0, 2, rows, k, n, group, int(glu), 0, bits) + x.tobytes() +
                     packed.codes.tobytes() + packed.scales.tobytes() + packed.mins.tobytes())
        sizes.append(4 * want.size)
        checks.append(("matmul", want))
    heads, kv_heads = 4, 2
    for hd, b, t, ends, slots in [(64, 1, 1, [40], 48), (64, 1, 9, [8], 48), (48, 2, 1, [5, 30], 48),
                                  (64, 2, 3, [10, 20], 48), (64, 1, 1, [300], 320)]:  # the last: pieces of slots
        cos, sin = _rope_tables(slots, hd)
        rng = np.random.default_rng(hd + t)
        k0, v0 = (rng.standard_normal((b, kv_heads, slots, hd)).astype(np.float32) for _ in range(2))
        qkv = rng.standard_normal((b, t, (heads + 2 * kv_heads) * hd)).astype(np.float32)
        cases.append(struct.pack("<10if", 1, 2, b, t, heads, kv_heads, hd, slots, slots, hd, hd ** -0.5) + qkv.tobytes() +
                     k0.tobytes() + v0.tobytes() + np.array(ends, np.int32).tobytes() + cos.tobytes() + sin.tobytes())
        sizes.append(4 + 4 * b * t * heads * hd + 8 * k0.size)
        checks.append(("attention", (b, t, heads * hd, k0.shape)))
    stdin = b"".join(cases)
    outs = {}
    for name, cmd in (("aarch64", [qemu, str(arm)]), ("host", [str(host)])):
        r = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode()[-400:]
        assert len(r.stdout) == sum(sizes)
        outs[name] = r.stdout
    at = 0
    for size, (kind, spec) in zip(sizes, checks):
        got, ref = (np.frombuffer(outs[n][at:at + size], np.uint8) for n in ("aarch64", "host"))
        at += size
        if kind == "matmul":
            got, ref = got.view(np.float32).reshape(spec.shape), ref.view(np.float32).reshape(spec.shape)
            np.testing.assert_allclose(got, spec, rtol=0, atol=2e-6 * np.abs(spec).max())
            np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(spec).max())
            continue
        b, t, width, cache = spec
        assert got[:4].view(np.int32)[0] == 0 == ref[:4].view(np.int32)[0]
        g, r = got[4:].view(np.float32), ref[4:].view(np.float32)
        n_out = b * t * width
        np.testing.assert_allclose(g[:n_out], r[:n_out], rtol=0, atol=2e-6 * np.abs(r[:n_out]).max())
        np.testing.assert_allclose(g[n_out:], r[n_out:], rtol=0, atol=1e-6)  # the caches with their new K/V
