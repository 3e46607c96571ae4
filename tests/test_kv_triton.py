"""The Triton kernels of the INT8 KV-cache (kernels/kv_triton.py) against their PyTorch reference
(kernels/kv_quant.py): quantise-on-write bit for bit (rounding ties included), decode attention within
FP16-dot tolerance, INT8 and FP16 caches, ragged lengths, GQA, several sequence splits. The `cuda`
tests run the compiled kernels on a GPU (quick: small shapes); without one, the same checks run once
in Triton's CPU interpreter when Triton is installed."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import Int8KVCache, attention_reference, quantize, tile_tokens
from triton_interpreter import HAS_TRITON, run_marked

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_probe(x_ptr, n):
        for i in range(0, n):  # a loop bound that is a runtime scalar, as in the decode kernel
            tl.store(x_ptr + i, i)


def interpreter_runs_loops() -> bool:
    """False where Triton's interpreter cannot iterate up to a runtime scalar: it calls int() on a
    1-element array, which numpy >= 2.4 refuses (triton-lang/triton#9171; Triton 3.6 with numpy 2.5 on
    the GPU machine's image hit it, Triton 3.9 squeezes the array first)."""
    x = torch.zeros(3)
    try:
        _loop_probe[(1,)](x, 3)
    except Exception as e:  # noqa: BLE001 - triton.runtime.errors.InterpreterError wraps the TypeError
        if "0-dimensional" in str(e):
            return False
        raise
    return bool(torch.equal(x, torch.arange(3.0)))


def check_quantize_write(device: str) -> None:
    from kernels.kv_triton import quantize_write

    torch.manual_seed(0)
    for group in (32, 64):
        fresh = torch.randn(2, 2, 3, 64, device=device, dtype=torch.float16) * 3
        # a group of exact ties: absmax 63.5 -> scale 0.5, the rest (k - 15) / 2 + 1/4 -> codes k - 15 + 1/2
        fresh[0, 0, 0, 0] = 63.5
        fresh[0, 0, 0, 1:group] = (torch.arange(group - 1, device=device) - 15) * 0.5 + 0.25
        qc = torch.zeros(3, 2, 40, 64, dtype=torch.int8, device=device)
        sc = torch.zeros(3, 2, 40, 64 // group, dtype=torch.float16, device=device)
        quantize_write(fresh, qc, sc, torch.tensor([2, 0], device=device), torch.tensor([5, 9], device=device))
        rq, rs = quantize(fresh, group)
        for i, (row, start) in enumerate(((2, 5), (0, 9))):
            assert torch.equal(sc[row, :, start:start + 3], rs[i])
            assert torch.equal(qc[row, :, start:start + 3], rq[i])  # bit for bit, ties to even included
        assert int(qc[1].abs().sum()) == 0 and int(qc[2, :, :5].abs().sum()) == 0  # nothing else written
        tiled = Int8KVCache((3, 2, 48, 64), group, device, token_tile=16)  # slots 5-7 and 9-11 span a tile edge
        quantize_write(fresh, tiled.q, tiled.scale, torch.tensor([2, 0], device=device),
                       torch.tensor([13, 14], device=device))
        assert torch.equal(tiled[2, :, 13:16].q, rq[0]) and torch.equal(tiled[0, :, 14:17].q, rq[1])
        assert torch.equal(tiled[2, :, 13:16].scale, rs[0])
        assert int(tiled.values().abs().sum()) == int(rq.abs().sum())  # nothing else written


def check_decode_attention(device: str) -> None:
    from kernels.kv_triton import decode_attention

    torch.manual_seed(1)
    b, h, kv, s, hd = 3, 6, 2, 300, 64
    q = torch.randn(b, h, hd, device=device)
    k, v = torch.randn(b, kv, s, hd, device=device), torch.randn(b, kv, s, hd, device=device)
    lengths = torch.tensor([300, 77, 1], device=device)
    for group in (32, 64):
        kq, ks = quantize(k, group)
        vq, vs = quantize(v, group)
        want = attention_reference(q, kq, ks, vq, vs, lengths)
        variants = [{"dense_scales": d, "cvt": c} for d in (True, False) for c in (0, 1, 2) if c < 2 or device == "cuda"]
        for splits, variant in [(1, {})] + [(4, v) for v in variants]:
            got = decode_attention(q, kq, vq, lengths, ks, vs, n_splits=splits, **variant)
            assert torch.allclose(got, want, atol=3e-3), float((got - want).abs().max())
        # V token-tiled, as Int8KVCache(token_tile=T) stores it; the capacity is a multiple of T (320)
        kt = torch.nn.functional.pad(kq, (0, 0, 0, 20))
        vt, kst, vst = (torch.nn.functional.pad(x, (0, 0, 0, 20)) for x in (vq, ks, vs))
        vt[:, :, s:] = 127  # slots past every length: whole tiles are read, these must weigh nothing
        for tile in (16, 32):
            tiled = tile_tokens(vt, tile)
            for splits in (1, 4):
                got = decode_attention(q, kt[:, :, :s], tiled, lengths, kst[:, :, :s], vst[:, :, :s], n_splits=splits)
                assert torch.allclose(got, want, atol=3e-3), (tile, float((got - want).abs().max()))
            # q quantised per (head, group), Q.K on the int8 tensor cores: q's rounding on top (1/254 of a row's max)
            got = decode_attention(q, kt[:, :, :s], tiled, lengths, kst[:, :, :s], vst[:, :, :s], n_splits=4, qk_int8=True)
            assert float((got - want).norm() / want.norm()) < 1e-2, (tile, float((got - want).norm() / want.norm()))
        with pytest.raises(ValueError, match="token-tiled"):
            decode_attention(q, kq, tiled, lengths, ks, vs, block_n=16)
    # FP16 cache through the same kernel, against plain softmax attention
    kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q, kk) / hd ** 0.5
    scores = scores.masked_fill(torch.arange(s, device=device)[None, None] >= lengths[:, None, None], float("-inf"))
    want = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), vv)
    got = decode_attention(q.half(), k.half(), v.half(), lengths, n_splits=3)
    assert torch.allclose(got, want, atol=3e-3), float((got - want).abs().max())
    # query row b reads cache row rows[b]: the cache's rows reversed and a reversed `rows` give the same result
    rows = torch.arange(b - 1, -1, -1, device=device, dtype=torch.int32)
    flipped = decode_attention(q.half(), k.half().flip(0), v.half().flip(0), lengths, rows=rows, n_splits=3)
    assert torch.equal(flipped, got)
    assert not torch.allclose(decode_attention(q.half(), k.half().flip(0), v.half().flip(0), lengths, n_splits=3),
                              want, atol=3e-3)  # without it, row b reads cache row b
    # BF16 cache through the custom op the compiled decode step calls (partition.model DECODE_PV = "triton")
    from kernels.kv_triton import dense_decode_attention

    got = dense_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths.to(torch.int32))
    # in q's dtype, rounded by the merge kernel's store (no cast kernel after it)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=3e-2), float((got.float() - want).abs().max())
    check_decode_attention_rope(device)


def check_decode_attention_rope(device: str) -> None:
    """The split kernel with the step's RoPE and cache write inside (decode_attention(rope=...), the ops behind
    partition.model.ROPE_IN_ATTENTION) against kernels.rope_triton.rope_write and then the plain kernels: caches,
    output and split partials bit for bit, q / k / v as strided column slices of one q/k/v row; the token's slot
    first, last and inside a split, at several split counts, for bf16 and fp16 caches."""
    from kernels.kv_triton import (decode_attention, dense_decode_attention, dense_decode_attention_rope,
                                   dense_decode_partials_rope)
    from kernels.rope_triton import rope_write

    torch.manual_seed(4)
    b, h, kv, s, hd = 4, 6, 2, 160, 64
    pos = torch.tensor([159, 64, 0, 100], device=device)  # the last slot, a split's first (64 slots), the first
    lengths = (pos + 1).to(torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        width = (h + 2 * kv) * hd + 16  # a wider row: q / k / v are column slices at its stride
        qkv = torch.randn(b, width, device=device).to(dtype)
        qx, kx, vx = qkv[:, :h * hd], qkv[:, h * hd:(h + kv) * hd], qkv[:, (h + kv) * hd:(h + 2 * kv) * hd]
        angle = pos.float()[:, None] * torch.rand(hd // 2, device=device)
        cos, sin = torch.cat((angle, angle), -1).cos().to(dtype), torch.cat((angle, angle), -1).sin().to(dtype)
        caches = torch.randn(2, b, kv, s, hd, device=device).to(dtype)
        want_k, want_v = caches[0].clone(), caches[1].clone()
        q = rope_write(qx, kx, vx, cos, sin, pos, want_k, want_v)
        assert not torch.equal(want_k, caches[0])  # the step's K is in
        for splits in (None, 1, 3):
            k, v = caches[0].clone(), caches[1].clone()
            got = decode_attention(qx.unflatten(-1, (h, hd)), k, v, lengths, n_splits=splits, out_dtype=dtype,
                                   rope=(kx, vx, cos, sin))
            assert torch.equal(k, want_k) and torch.equal(v, want_v), (dtype, splits)
            want = decode_attention(q, want_k, want_v, lengths, n_splits=splits, out_dtype=dtype)
            assert torch.equal(got, want), (dtype, splits, float((got.float() - want.float()).abs().max()))
        k, v = caches[0].clone(), caches[1].clone()
        got = dense_decode_attention_rope(qx.unflatten(-1, (h, hd)), kx, vx, cos, sin, k, v, lengths)
        assert torch.equal(got, dense_decode_attention(q, want_k, want_v, lengths)) and torch.equal(k, want_k)
        k, v = caches[0].clone(), caches[1].clone()
        parts = dense_decode_partials_rope(qx.unflatten(-1, (h, hd)), kx, vx, cos, sin, k, v, lengths)
        want_parts = decode_attention(q, want_k, want_v, lengths, merge=False)
        assert all(torch.equal(x, y) for x, y in zip(parts, want_parts)) and torch.equal(v, want_v)
    with pytest.raises(ValueError, match="dense cache"):
        decode_attention(qx.unflatten(-1, (h, hd)), k, v, lengths, rows=lengths, rope=(kx, vx, cos, sin))
    # the ops' schemas (the caches declared mutated) and fake implementations, what the compiled step traces through
    for op in (dense_decode_attention_rope, dense_decode_partials_rope):
        torch.library.opcheck(op, (qx.unflatten(-1, (h, hd)), kx, vx, cos, sin, caches[0].clone(), caches[1].clone(),
                                   lengths), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.cuda
def test_quantize_write_cuda() -> None:
    check_quantize_write("cuda")


@pytest.mark.cuda
def test_decode_attention_cuda() -> None:
    check_decode_attention("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.interpreter("from tests.test_kv_triton import check_quantize_write; check_quantize_write('cpu')",
                         "from tests.test_kv_triton import check_decode_attention; check_decode_attention('cpu')",
                         timeout=300)
def test_kernels_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    """The same checks on CPU through TRITON_INTERPRET=1 (read when the kernels are defined, hence a
    fresh interpreter)."""
    run_marked(request)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_decode_split_kernel_with_rope_compiles_for_orin_and_hopper(arch: int) -> None:
    """The split kernel with RoPE and the cache write (ROPE) compiles to SASS for sm_87 (Orin) and sm_90 without a
    GPU (scripts/kv_kernel_sass.py's compile), at Llama-3-8B's head_dim 128 and SmolLM2's 64, with no spills in its
    slot loop: the same loop as without ROPE (the same matrix instructions), one barrier more (the write's).
    Measured with Triton 3.9: sm_87 spills nothing; sm_90 at head_dim 128 keeps two 4-byte values on the stack
    across the loop (stored before it, loaded after)."""
    import re

    from kernels import kv_triton as kt
    from scripts.kv_kernel_sass import compile_kernel, cuobjdump, main_loop_opcodes, resources

    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i32", "rows_ptr": "*i32",
            "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
    rope_ptrs = {**ptrs, "kn_ptr": "*bf16", "vn_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "sn_b": "i32",
                 "sc_b": "i32"}
    for hd, hpk in ((128, 4), (64, 3)):
        consts = {"HPK": hpk, "HD": hd, "BLOCK_H": kt.BLOCK_H, "BLOCK_N": 64, "HAS_ROWS": False}
        plain = cuobjdump(compile_kernel(kt._decode_split_kernel, ptrs, consts, arch, 4, 3), "-sass")
        k = compile_kernel(kt._decode_split_kernel, rope_ptrs, {**consts, "ROPE": True}, arch, 4, 3)
        sass = cuobjdump(k, "-sass")
        loop, plain_loop = main_loop_opcodes(sass), main_loop_opcodes(plain)
        assert not any(op.startswith(("LDL", "STL")) for op in loop), (hd, loop)
        mma = {op: n for op, n in plain_loop.items() if "MMA" in op}
        assert mma and {op: n for op, n in loop.items() if "MMA" in op} == mma, (hd, loop, plain_loop)
        assert len(re.findall(r"BAR\.SYNC", sass)) == len(re.findall(r"BAR\.SYNC", plain)) + 1, hd
        if arch == 87:
            assert resources(k)["stack_bytes"] == 0, (hd, resources(k))


def test_the_kernel_modules_and_the_torch_runner_import_without_triton() -> None:
    """A board's PyTorch has no Triton (JetPack ships none; kernels/kv_triton.py's docstring), nor has the edge
    server's Python: every kernels module, the model and the runners import without it, the Triton ones say they are
    unavailable, and the shipped model runs a forward on the CPU."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import importlib.abc, importlib.machinery, sys
class NoTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] == "triton" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise ImportError("No module named 'triton' (hidden by the test)")
sys.meta_path.insert(0, NoTriton())
import importlib, pkgutil
import kernels
for m in pkgutil.iter_modules(kernels.__path__):  # every kernels module, the Triton ones and the rest
    importlib.import_module("kernels." + m.name)
from kernels import int4_triton, kv_triton, norm_triton, pdl, rope_triton
import partition.runners.torch_runner, partition.runners, partition.model
assert not (kv_triton.available() or rope_triton.available() or norm_triton.available() or int4_triton.available())
assert not pdl.triton_supports()
import numpy as np
from partition.paths import DEFAULT_MODEL_DIR
from partition.runners import load_chain
chain = load_chain(DEFAULT_MODEL_DIR, backend="torch", max_seq=32)  # the shipped model on the CPU, as a board runs it
out = np.asarray(chain.forward(np.array([[5, 9, 33]], dtype=np.int32), np.arange(3, dtype=np.int32)[None]))
from partition.config import load_config
assert out.shape[-1] == load_config(DEFAULT_MODEL_DIR).vocab_size and np.isfinite(out).all()
print("imported")
"""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-2000:]
