"""kernels/norm_triton.py against partition.model's eager formulation: RMSNorm, the residual add fused into it,
and SiLU(gate) * up, in fp32 / fp16 / bf16, one row and many, a hidden size that is not a power of two (SmolLM2's
576), an intermediate size over two column blocks; then a whole model (fused gate/up) with the kernels on against
off. Without a GPU the kernels run in Triton's CPU interpreter (a fresh process, skipped where Triton is not
installed); on CUDA the same checks run compiled."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import HAS_TRITON, run_marked


def _eager_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_kernels(device: str) -> None:
    from kernels.norm_triton import add_rms_norm, applies, rms_norm, silu_mul

    eps = 1e-5
    for dtype, shape in ((torch.float32, (1, 1, 576)), (torch.float16, (3, 7, 576)), (torch.bfloat16, (2, 5, 384))):
        g = torch.Generator().manual_seed(shape[1])
        x = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
        res = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(device=device, dtype=dtype)
        assert applies(x, w) and not applies(x, w.float() if dtype != torch.float32 else w.half())
        # a rounding to dtype apart at most (the mean's sum runs in another order; the interpreter may truncate bf16)
        tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -6}[dtype]
        want = _eager_norm(x, w, eps)
        got = rms_norm(x, w, eps)
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (dtype, (got - want).abs().max())
        normed, summed = add_rms_norm(x, res, w, eps)
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's fp32 -> bf16 cast is not ATen's rounding
            assert torch.allclose(summed.float(), (x + res).float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(summed, x + res), dtype  # the residual stream bit for bit
        want = _eager_norm(x + res, w, eps)
        assert torch.allclose(normed.float(), want.float(), rtol=tol, atol=tol), (dtype, (normed - want).abs().max())
        inter = 1536  # two column blocks of SILU_BLOCK
        gate_up = torch.randn((*shape[:-1], 2 * inter), generator=g).to(device=device, dtype=dtype) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = silu_mul(gate_up)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (dtype, (got - want).abs().max())
        check_act8_outputs(x, res, w, eps, gate_up)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, res[..., :-1], w, eps)
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(gate_up[..., :-1])


def check_act8_outputs(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                       gate_up: torch.Tensor) -> None:
    """The `_a8` ops: the same outputs as the plain ones, and codes equal to kernels.int4_triton.act8_quant's of
    that output, bit for bit (what lets a decode step take them in place of a quantise launch per GEMV), with the
    code bits ACT says (8 for "int8", 16 for "int16")."""
    from kernels import int4_triton as it
    from kernels.norm_triton import add_rms_norm, add_rms_norm_a8, rms_norm, rms_norm_a8, silu_mul, silu_mul_a8

    default = it.ACT
    try:
        for act, bits in (("int8", 8), ("int16", 16)):
            it.ACT = act
            rows = x.reshape(-1, x.shape[-1]).shape[0]
            y, q = rms_norm_a8(x, w, eps)
            assert torch.equal(y, rms_norm(x, w, eps)) and q.shape == (rows, it.act8_width(x.shape[-1], bits))
            _same_act8(q, it.act8_quant(y.reshape(rows, -1), bits), bits)
            y, h, q = add_rms_norm_a8(x, res, w, eps)
            want_y, want_h = add_rms_norm(x, res, w, eps)
            assert torch.equal(y, want_y) and torch.equal(h, want_h)
            _same_act8(q, it.act8_quant(y.reshape(rows, -1), bits), bits)
            y, q = silu_mul_a8(gate_up)
            assert torch.equal(y, silu_mul(gate_up))
            _same_act8(q, it.act8_quant(y.reshape(rows, -1), bits), bits)
            wide = torch.randn(2, 4096, device=x.device, dtype=x.dtype)  # past NORM_ACT8_CHUNK: a row over 4 programs
            ww = torch.ones(4096, device=x.device, dtype=x.dtype)
            y, h, q = add_rms_norm_a8(wide, wide.flip(0), ww, eps)
            want_y, want_h = add_rms_norm(wide, wide.flip(0), ww, eps)
            assert torch.equal(y, want_y) and torch.equal(h, want_h)
            _same_act8(q, it.act8_quant(y, bits), bits)
            with pytest.raises(ValueError, match="multiple of 64"):
                rms_norm_a8(x[..., :-32].contiguous(), w[:-32], eps)
    finally:
        it.ACT = default


def _same_act8(got: torch.Tensor, want: torch.Tensor, bits: int = 8) -> None:
    """Two ACT8_FORMAT tensors hold the same codes and scales bit for bit, and the same block sums up to their order
    of addition (a compiled kernel may sum a block in another order than another kernel does)."""
    from kernels.int4_triton import act8_unpack

    assert got.shape == want.shape and got.dtype == want.dtype == torch.int8
    (gc, gd, gs), (wc, wd, ws) = act8_unpack(got, bits), act8_unpack(want, bits)
    assert torch.equal(gc, wc) and torch.equal(gd, wd), float((gc.float() - wc.float()).abs().max())
    assert torch.allclose(gs, ws, rtol=1e-6, atol=1e-5), float((gs - ws).abs().max())


def _int4_model(device: str, seed: int, lm_head: bool, norm_weights: bool = False) -> "torch.nn.Module":
    """A random 2-layer model quantised to INT4 g32 on kernels.int4_triton (in the interpreter on CPU tensors), q/k/v
    and gate/up fused; norm_weights: each RMSNorm its own random weight (else all ones)."""
    import partition.model as pm
    from kernels.weight_only import QuantLinear
    from partition.checkpoint import random_model
    from partition.config import ModelConfig
    from partition.quantize import default_spec, quantize_model

    cfg = ModelConfig("LlamaForCausalLM", 320, 128, 2, 4, 2, 32, 256, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    model = random_model(cfg, seed=seed, dtype=torch.float32, device=device)
    if norm_weights:
        gen = torch.Generator().manual_seed(seed)
        for norm in [model.model.norm, *(n for layer in model.model.layers
                                         for n in (layer.input_layernorm, layer.post_attention_layernorm))]:
            norm.weight.data = (torch.rand(cfg.hidden_size, generator=gen) + 0.5).to(device)
    pick = QuantLinear._pick_kernel
    if device == "cpu":  # the interpreter runs the CUDA kernel choice's Triton kernels on CPU tensors
        QuantLinear._pick_kernel = lambda self, *a: "int4_triton"
    try:
        model = quantize_model(model, default_spec(4, 32), lm_head=lm_head)
        assert pm.fuse_quantized_projections(model) == 2
    finally:
        QuantLinear._pick_kernel = pick
    return model


def check_act8_model(device: str) -> None:
    """A 2-layer INT4 model on kernels.int4_triton with int8 activations (ACT "int8", fused gate/up and q/k/v, a
    quantised lm_head): with the codes made by the norms and SiLU * up (partition.model.ACT8_FUSED) a decode-sized
    forward gives the logits of each GEMV quantising its own input (bit for bit in the interpreter), with one
    quantise launch a layer
    (o_proj's) instead of four a layer and the head's; those logits are the exact activations' within int8's error;
    a prefill-sized forward takes the float path (no codes)."""
    import partition.model as pm
    from kernels import int4_triton as it
    from kernels.weight_only import QuantLinear

    model = _int4_model(device, seed=5, lm_head=True)
    assert {m.kernel for m in model.modules() if isinstance(m, QuantLinear)} == {"int4_triton"}
    sl = model.slice(0, 2)
    calls = []
    quant = it.act8_quant
    defaults = it.ACT, it.REDUCE, it.act8_quant, pm.ACT8_FUSED, pm.GEMV_EPILOGUES

    def counted(x: torch.Tensor, bits: int = 8, weight: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape)
        return quant(x, bits, weight=weight)

    def run(t: int, act: str, fused: bool, layers: int = 2, epilogues: bool = False) -> torch.Tensor:
        it.ACT, pm.ACT8_FUSED, pm.GEMV_EPILOGUES = act, fused, epilogues
        calls.clear()
        ids = torch.arange(3, 3 + t, dtype=torch.int32, device=device)[None]
        pos = torch.arange(t, dtype=torch.int32, device=device)[None]
        with torch.inference_mode():
            past = [torch.zeros(1, 2, 0, 32, device=device) for _ in range(2 * layers)]
            return (sl if layers == 2 else model.slice(0, layers))(ids, pos, *past)[0]

    try:
        it.REDUCE, it.act8_quant = "last", counted  # "last": sums in a fixed order, so runs compare bit for bit
        # int8's rounding through 9 GEMVs of a random model (0.7-2.3 % each, 7.9 % in the logits, measured in the
        # interpreter), int16's (~1e-5 each): off by that much, not by a wrong layout
        for act, tol in (("int8", 0.15), ("int16", 2e-3)):
            for t in (1, 3):
                unfused = run(t, act, False)
                assert len(calls) == 2 * 4 + 1, calls
                fused = run(t, act, True)
                assert len(calls) == 2 and all(c == (t, 128) for c in calls), calls  # o_proj's
                # compiled, a block sum's last bit may differ between kernels (_same_act8), and so a code one layer
                # on may round the other way: one int8 step of one value (on an H200, 0.0021 with logits up to ~0.7)
                diff = float((fused - unfused).abs().max())
                assert diff == 0 if device == "cpu" else diff <= 0.01 * float(unfused.abs().max()), (act, t, diff)
                exact = run(t, "exact", True)
                assert not calls and float((fused - exact).norm() / exact.norm()) < tol, (act, t)
            prefill = run(8, act, True, layers=1)  # hidden states out (a prefill's head reads one row: the GEMV)
            assert not calls and torch.equal(prefill, run(8, "exact", True, layers=1))
            # the GEMVs' epilogues writing the next GEMV's codes (int4_gemv_epilogue_a8): one quantise a step (the
            # first q/k/v's input) instead of one a layer, o_proj on the attention's output as it is; the logits
            # within the codes' error of the exact step's with epilogues, and of the step without them
            for t in (1, 3):
                epi = run(t, act, True, epilogues=True)
                assert len(calls) == 1 and calls[0] == (t, 128), calls
                exact = run(t, "exact", True, epilogues=True)
                assert float((epi - exact).norm() / exact.norm()) < tol, (act, t)
                plain = run(t, act, True)
                assert float((epi - plain).norm() / plain.norm()) < tol, (act, t)
    finally:
        it.ACT, it.REDUCE, it.act8_quant, pm.ACT8_FUSED, pm.GEMV_EPILOGUES = defaults


def check_epilogue_model(device: str) -> None:
    """A 2-layer INT4 model on kernels.int4_triton (fused q/k/v and gate/up): a decode step with the norms, residual
    adds and SiLU * up in the GEMVs' epilogues (partition.model.GEMV_EPILOGUES) gives the logits and K/V of the step
    with those kernels, in the export formulation and in in-place cache mode, with four epilogue GEMVs a layer and
    one norm kernel (the final norm's) instead of two a layer and the SiLU's; a prefill takes the kernels."""
    import partition.model as pm
    from kernels import int4_triton as it
    from kernels import norm_triton

    flags = ("GEMV_EPILOGUES", "ROPE_EPILOGUE", "LEAN_PROLOGUE", "MERGE_IN_O", "ROPE_IN_ATTENTION")
    defaults = {f: getattr(pm, f) for f in flags}  # restored at the end, whatever they are
    model = _int4_model(device, seed=6, lm_head=False, norm_weights=True)
    sl = model.slice(0, 2)
    calls: list[str] = []
    saved = {n: getattr(norm_triton, n) for n in ("rms_norm", "add_rms_norm", "silu_mul")}
    epilogue = it.int4_gemv_epilogue

    def counting(name, f):
        def g(*a, **kw):
            calls.append(name)
            return f(*a, **kw)
        return g

    def step(on: bool, in_place: bool, t: int = 1) -> tuple[torch.Tensor, ...]:
        pm.GEMV_EPILOGUES = on
        calls.clear()
        ids = torch.arange(5, 5 + t, dtype=torch.int32, device=device)[None]
        with torch.inference_mode():
            if in_place:  # 6 tokens in the caches, this step writes slot 6
                pos = torch.arange(6, 6 + t, dtype=torch.int32, device=device)[None]
                past = [torch.randn(1, 2, 16, 32, generator=torch.Generator().manual_seed(i)).to(device)
                        for i in range(4)]
                out = sl.run(ids, pos, *past, cache_in_place=True)
                return (out[0], *past)
            pos = torch.arange(t, dtype=torch.int32, device=device)[None]
            past = [torch.zeros(1, 2, 0, 32, device=device) for _ in range(4)]
            return sl(ids, pos, *past)

    try:
        for f, on in zip(flags, (True, False, True, False, False)):  # each formulation is set where it is checked
            setattr(pm, f, on)
        for n, f in saved.items():
            setattr(norm_triton, n, counting(n, f))
        it.int4_gemv_epilogue = counting("epilogue", epilogue)
        for in_place in (False, True):
            plain = step(False, in_place)
            assert sorted(calls) == ["add_rms_norm"] * 4 + ["rms_norm", "silu_mul", "silu_mul"], calls
            fused = step(True, in_place)
            assert sorted(calls) == ["epilogue"] * 8 + ["rms_norm"], calls
            for a, b in zip(fused, plain):  # fp32: the products' order of rounding apart
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (in_place, float((a - b).abs().max()))
        step(True, False, t=5)  # a prefill: rows past the GEMV's
        assert "epilogue" not in calls and "silu_mul" in calls
        # RoPE and the cache write in the q/k/v GEMV's epilogue (ROPE_EPILOGUE), against rope_write's kernel a launch
        # later: logits and caches bit for bit, one int4_gemv_rope a layer and no rope_write. The Triton decode path
        # (dense_decode_attention, rope_write) runs on the CPU too in the interpreter, where it is let in.
        from kernels import rope_triton

        shapes, rope_gemv, rope_write = pm._triton_decode_shapes, it.int4_gemv_rope, rope_triton.rope_write
        mask_fn = pm.cache_mask
        merge_op = it.int4_gemv_merge
        if device == "cpu":
            pm._triton_decode_shapes = lambda q, hd, grp, pv=None: hd & (hd - 1) == 0 and grp <= 16
        it.int4_gemv_rope = counting("rope_epilogue", rope_gemv)
        rope_triton.rope_write = counting("rope_write", rope_write)
        try:
            plain = step(True, True)
            assert calls.count("rope_write") == 2 and "rope_epilogue" not in calls, calls
            pm.ROPE_EPILOGUE = True
            fused = step(True, True)
            assert calls.count("rope_epilogue") == 2 and "rope_write" not in calls, calls
            for a, b in zip(fused, plain):
                assert torch.equal(a, b), float((a - b).abs().max())
            # the lean prologue (LEAN_PROLOGUE): no mask where every layer attends through the Triton decode kernel;
            # the same logits and caches as the step that builds it
            pm.ROPE_EPILOGUE = False
            pm.cache_mask = counting("cache_mask", mask_fn)
            lean = step(True, True)
            assert "cache_mask" not in calls, calls
            pm.LEAN_PROLOGUE = False
            full = step(True, True)
            assert calls.count("cache_mask") == 1, calls
            for a, b in zip(lean, full):
                assert torch.equal(a, b), float((a - b).abs().max())
            # the attention's merge in o_proj's GEMV (MERGE_IN_O), with and without the RoPE epilogue: one
            # int4_gemv_merge a layer in place of o_proj's epilogue GEMV, the logits and caches those of the merge
            # kernel's step (bit for bit in the interpreter; on a GPU to fp32's summation order, which may differ)
            pm.LEAN_PROLOGUE, pm.cache_mask = True, mask_fn
            it.int4_gemv_merge = counting("merge", merge_op)
            for rope_epi in (False, True):
                pm.ROPE_EPILOGUE, pm.MERGE_IN_O = rope_epi, False
                plain = step(True, True)
                assert "merge" not in calls and calls.count("epilogue") == (6 if rope_epi else 8), calls
                pm.MERGE_IN_O = True
                merged = step(True, True)
                assert calls.count("merge") == 2 and calls.count("epilogue") == (4 if rope_epi else 6), calls
                for a, b in zip(merged, plain):
                    assert (torch.equal(a, b) if device == "cpu" else torch.allclose(a, b, rtol=1e-5, atol=1e-6)), \
                        (rope_epi, float((a - b).abs().max()))
            # RoPE and the cache write in the attention's split kernel (ROPE_IN_ATTENTION), with the GEMV epilogues
            # and without, with the merge in o_proj and without: no rope_write, the logits and caches bit for bit
            # (the merge in o_proj on a GPU to fp32's summation order, as above)
            from kernels import kv_triton

            pm.ROPE_EPILOGUE = False
            ops = {n: getattr(kv_triton, n) for n in ("dense_decode_attention_rope", "dense_decode_partials_rope")}
            for n, f in ops.items():
                setattr(kv_triton, n, counting(n, f))
            try:
                for epilogues, merge in ((True, False), (True, True), (False, False)):
                    pm.ROPE_IN_ATTENTION, pm.MERGE_IN_O = False, merge
                    plain = step(epilogues, True)
                    assert calls.count("rope_write") == 2, calls
                    pm.ROPE_IN_ATTENTION = True
                    fused = step(epilogues, True)
                    op = "dense_decode_partials_rope" if merge else "dense_decode_attention_rope"
                    assert calls.count(op) == 2 and "rope_write" not in calls, (epilogues, merge, calls)
                    for a, b in zip(fused, plain):
                        assert (torch.equal(a, b) if device == "cpu" or not merge
                                else torch.allclose(a, b, rtol=1e-5, atol=1e-6)), \
                            (epilogues, merge, float((a - b).abs().max()))
                step(True, True, t=5)  # a prefill chunk: rope_write, as before
                assert calls.count("rope_write") == 2 and not any(n in calls for n in ops), calls
            finally:
                for n, f in ops.items():
                    setattr(kv_triton, n, f)
        finally:
            pm._triton_decode_shapes, it.int4_gemv_rope, rope_triton.rope_write = shapes, rope_gemv, rope_write
            pm.cache_mask = mask_fn
            it.int4_gemv_merge = merge_op
    finally:
        for n, f in saved.items():
            setattr(norm_triton, n, f)
        it.int4_gemv_epilogue = epilogue
        for f, on in defaults.items():
            setattr(pm, f, on)


def check_traceable(device: str) -> None:
    """The three ops inside torch.compile(fullgraph=True) (aot_eager: their fake implementations and
    functionalisation, what the compiled decode step traces through) give what they give eagerly."""
    from kernels.norm_triton import add_rms_norm, add_rms_norm_a8, rms_norm, rms_norm_a8, silu_mul, silu_mul_a8

    w = torch.linspace(0.5, 1.5, 64, device=device)

    def f(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        n, h = add_rms_norm(x, r, w, 1e-5)
        return silu_mul(torch.cat([rms_norm(h, w, 1e-5), n], -1))

    def g(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, h, q1 = add_rms_norm_a8(x, r, w, 1e-5)
        y, q2 = rms_norm_a8(h, w, 1e-5)
        return (*silu_mul_a8(torch.cat([y, n], -1)), q1, q2)

    x, r = torch.randn(2, 64, device=device), torch.randn(2, 64, device=device)
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(x, r), f(x, r))
    for got, want in zip(torch.compile(g, backend="aot_eager", fullgraph=True)(x, r), g(x, r)):
        assert torch.equal(got, want)


def check_model(device: str) -> None:
    """A random 2-layer model with fused gate/up: logits and K/V with the kernels equal those without, for the whole
    model and for its first layer alone as a slice (hidden states out: the last MLP output added at the end)."""
    import partition.model as pm
    from partition.checkpoint import random_model
    from partition.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 300, 192, 2, 6, 2, 32, 1000, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    model = pm.fuse_projections(random_model(cfg, seed=3, dtype=torch.float32, device=device))
    ids = torch.arange(1, 9, dtype=torch.int32, device=device)[None]
    pos = torch.arange(8, dtype=torch.int32, device=device)[None]
    for end in (2, 1):
        sl = model.slice(0, end)
        past = [torch.zeros(1, 2, 0, 32, device=device) for _ in range(2 * end)]
        with torch.inference_mode():
            fused = sl(ids, pos, *past)
            pm.FUSED_ELEMENTWISE = False
            try:
                eager = sl(ids, pos, *past)
            finally:
                pm.FUSED_ELEMENTWISE = True
        assert fused[0].shape == ((1, 1, 300) if end == 2 else (1, 8, 192))
        for a, b in zip(fused, eager):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (end, (a - b).abs().max())


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.interpreter("from tests.test_norm_triton import check_kernels, check_traceable; "
                         "check_kernels('cpu'); check_traceable('cpu')",
                         "from tests.test_norm_triton import check_act8_model, check_epilogue_model, check_model; "
                         "check_model('cpu'); check_act8_model('cpu'); check_epilogue_model('cpu')", timeout=600)
def test_norm_kernels_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run_marked(request)


def test_kernels_stay_off_on_a_plain_cpu_tensor() -> None:
    """Without the interpreter a CPU tensor keeps the eager formulation (the ONNX export traces it)."""
    import os

    from kernels.norm_triton import applies

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    assert not applies(torch.zeros(2, 8))


@pytest.mark.cuda
def test_norm_kernels_cuda() -> None:
    check_kernels("cuda")
    check_model("cuda")
    check_traceable("cuda")
    check_act8_model("cuda")
    check_epilogue_model("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_norm_kernels_compile_for_orin_and_hopper(arch: int) -> None:
    """Both kernels compile to SASS for sm_87 (Orin) and sm_90 without a GPU (scripts/kv_kernel_sass.py's
    compile), with no spills to the stack, at SmolLM2's hidden size (1024-column block) and in fp16, with and
    without their int8 (ACT8_FORMAT) output, and at Llama-3-8B's 4096 (8 warps, chunked) with it."""
    from kernels import norm_triton
    from scripts.kv_kernel_sass import compile_kernel, resources

    types = {**{n: "*fp16" for n in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr")}, "q_ptr": "*i8", "eps": "fp32"}
    for act8, block, warps, chunk in ((False, 1024, 4, 0), (True, 1024, 4, 0), (True, 4096, 8, 1024)):
        norm = compile_kernel(norm_triton._rms_norm_kernel, types,
                              {"HAS_RES": True, "BLOCK": block, "ACT8": act8, "CHUNK": chunk}, arch, warps=warps,
                              stages=1)
        silu = compile_kernel(norm_triton._silu_mul_kernel, {"g_ptr": "*fp16", "y_ptr": "*fp16", "q_ptr": "*i8"},
                              {"BLOCK": norm_triton.SILU_BLOCK, "ACT8": act8}, arch, warps=4, stages=1)
        for k in (norm, silu):
            assert k.asm["cubin"] and resources(k)["stack_bytes"] == 0, (act8, block)
