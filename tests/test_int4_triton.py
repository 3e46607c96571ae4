"""kernels/int4_triton.py against the plain dequantise-then-matmul of kernels/weight_only.py: the packed
layout round-trips, the GEMV and the dequantise kernel match the reference (zero-point and float-min
forms, groups 32 / 64 / 128, fp32 / bf16 / fp16 activations, several rows, uneven N and split-K, an
activation spread over many orders of magnitude; int8 activations on dp4a), and the custom ops trace whole
under torch.compile.
Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, a fresh process; skipped
where Triton is not installed); the `cuda` tests in tests/test_cuda_quant.py run them compiled."""
from __future__ import annotations

import pytest
import torch

from kernels import int4_triton as it
from kernels.weight_only import dequantize
from triton_interpreter import HAS_TRITON, run_marked


def _weights(n: int, k: int, group: int, mins: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    w = {"q": q, "scales": s, "g_idx": torch.arange(k) // group}
    if mins:
        w["mins"] = -torch.rand(n, k // group, generator=g) * 0.1
    else:
        w["zeros"] = torch.randint(0, 16, (n, k // group), generator=g)
    return w


def _reference(w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight (N, K) fp32 as kernels.weight_only dequantises it, with s and b rounded to fp16 as
    `pack` stores them (so the kernels can be held to fp32 rounding, not to fp16's)."""
    s = w["scales"].half().float()
    if "mins" in w:
        return dequantize(w["q"], s, None, w["g_idx"], w["mins"].half().float())
    b = (-w["zeros"].float() * w["scales"]).half().float()
    return dequantize(w["q"], s, None, w["g_idx"], b)


def test_the_model_knows_the_gemv_row_limit() -> None:
    from partition.model import INT4_GEMV_MAX_M

    assert INT4_GEMV_MAX_M == it.GEMV_MAX_M


def test_pack_round_trips_codes_and_rejects_bad_shapes() -> None:
    w = _weights(24, 96, 32, mins=False, seed=0)
    codes, sb = it.pack(w["q"][:, :64], w["scales"][:, :2], zeros=w["zeros"][:, :2], tile_n=16)
    assert codes.dtype == torch.int32 and codes.shape == (2, 1, 16, 8) and sb.shape == (2, 2, 16, 2)
    assert it.pack(w["q"][:, :64], w["scales"][:, :2], zeros=w["zeros"][:, :2])[0].shape == (1, 1, 128, 8)
    assert torch.equal(it.unpack(codes, 24), w["q"][:, :64])
    s, z = w["scales"][:, :2], w["zeros"][:, :2].float()
    assert torch.equal(it.unpack_sb(sb, 24), torch.stack([s, -z * s], dim=-1).half())  # (N, G, 2): s and b = -z s
    assert int(codes[1, :, 8:].abs().sum()) == 0 and int(sb[1, :, 8:].abs().sum()) == 0  # rows past N: zero
    assert int(codes.min()) < 0  # codes >= 8 in nibble 7 set the sign bit: the layout keeps all 32 bits
    with pytest.raises(ValueError, match="multiple of 64"):
        it.pack(w["q"], w["scales"], zeros=w["zeros"])
    with pytest.raises(ValueError, match="either zeros"):
        it.pack(w["q"][:, :64], w["scales"][:, :2])
    assert it.supports(4096, 4096, 128) and it.supports(576, 576, 32) and it.supports(100, 1536, 256)
    assert not it.supports(64, 96, 32) and not it.supports(64, 128, 16)


def test_carve_sms_sets_the_carveout_and_restores_it() -> None:
    """carve_sms(n): cuBLAS's SM carveout is n until the returned function runs, then what it was (None: unset);
    carve_sms(0) changes nothing. (This CPU build has no cuBLASLt to prefer; the GPU test checks that part.)"""
    before = torch._C._get_sm_carveout_experimental()
    assert it.carve_sms(0) is None and torch._C._get_sm_carveout_experimental() == before
    restore = it.carve_sms(24)
    try:
        assert torch._C._get_sm_carveout_experimental() == 24
    finally:
        restore()
    assert torch._C._get_sm_carveout_experimental() == before


def test_gemv_config_fills_the_gpu_with_short_splits() -> None:
    for n, k in ((1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (576, 576), (128256, 4096)):
        _, split, _ = it.gemv_config(n, k, 132)
        steps = k // 64 // split
        assert split & (split - 1) == 0 and (split == 1 or steps >= 2), (n, k, split)
        assert split == 1 or -(-n // it.tile_rows(n)) * split <= 16 * 132, (n, k, split)
    # the settings the H200 sweep measured best for Llama-3-8B (docs/BENCHMARKS.md)
    assert [it.gemv_config(n, k, 132)[1] for n, k in ((14336, 4096), (4096, 14336), (128256, 4096), (1024, 4096))] \
        == [32, 64, 8, 32]
    assert it.gemv_split(1024, 4096, torch.device("cpu")) == it.gemv_config(1024, 4096, 132)[1]


def test_gemv_split_with_the_loop_loading_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PDL or PREFETCH (the loop loads a step ahead) a split keeps at most 8 programs an SM by default
    (AHEAD_SPLIT 2: of Llama-3-8B's GEMVs only gate/up and an INT4 head change, the H100's int16 measurement in
    docs/BENCHMARKS.md); rule 1 also divides the steps (the H200 anatomy's best splits); rule 0 is the dense rule."""
    from kernels import pdl

    assert it.AHEAD_SPLIT == 2
    for (n, k), (dense, ahead) in {(28672, 4096): (32, 16), (4096, 14336): (64, 64), (6144, 4096): (32, 32),
                                   (4096, 4096): (32, 32), (128256, 4096): (8, 4), (576, 1536): (8, 8)}.items():
        assert (it.gemv_config(n, k, 132)[1], it.gemv_config(n, k, 132, ahead=True)[1]) == (dense, ahead), (n, k)
    monkeypatch.setattr(it, "AHEAD_SPLIT", 0)
    assert it.gemv_config(28672, 4096, 132, ahead=True)[1] == 32
    monkeypatch.setattr(it, "AHEAD_SPLIT", 1)

    for (n, k), (dense, ahead) in {(28672, 4096): (32, 16), (4096, 14336): (64, 32), (6144, 4096): (32, 32),
                                   (4096, 4096): (32, 32), (576, 1536): (8, 8)}.items():
        assert (it.gemv_config(n, k, 132)[1], it.gemv_config(n, k, 132, ahead=True)[1]) == (dense, ahead), (n, k)
        assert (k // 64) % ahead == 0 and -(-n // it.tile_rows(n)) * ahead <= 8 * 132
    monkeypatch.setattr(it, "_sm_count", lambda index: 132)
    monkeypatch.setattr(pdl, "triton_supports", lambda: True)
    cuda = torch.device("cuda", 0)
    for capability, prefetch, rule, split in (((9, 0), 0, 1, 32), ((9, 0), 0, 0, 64), ((8, 7), 0, 1, 64),
                                              ((8, 7), 1, 1, 32), ((9, 0), 0, 2, 64)):
        monkeypatch.setattr(pdl, "_device_supports", lambda index, c=capability: c >= pdl.MIN_CAPABILITY)
        monkeypatch.setattr(it, "PREFETCH", prefetch)
        monkeypatch.setattr(it, "AHEAD_SPLIT", rule)
        assert it.gemv_split(4096, 14336, cuda) == split, (capability, prefetch, rule)
    monkeypatch.setattr(it, "AHEAD_SPLIT", 2)
    monkeypatch.setattr(it, "PREFETCH", 0)
    for capability, split in (((9, 0), 16), ((8, 7), 32)):  # gate/up: PDL on Hopper, none on Orin
        monkeypatch.setattr(pdl, "_device_supports", lambda index, c=capability: c >= pdl.MIN_CAPABILITY)
        assert it.gemv_split(28672, 4096, cuda) == split, capability
    monkeypatch.setattr(pdl, "MODE", "off")  # PDL off, PREFETCH 0: the dense rule on Hopper too
    monkeypatch.setattr(it, "PREFETCH", 0)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    assert it.gemv_split(4096, 14336, cuda) == 64


def test_fake_impls_give_shapes_and_dtypes_without_running_a_kernel() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 256, dtype=torch.bfloat16)
        codes = torch.empty(1, 4, 256, 8, dtype=torch.int32)
        sb = torch.empty(1, 2, 256, 2, dtype=torch.float16)
        part = torch.ops.orin_agent.int4_gemv(x, codes, sb, 40, 128, 4)
        wd = torch.ops.orin_agent.int4_dequant(codes, sb, 40, 128, torch.float16)
    assert part.shape == (4, 3, 40) and part.dtype == torch.float32
    assert wd.shape == (40, 256) and wd.dtype == torch.float16


CASES = [(40, 256, 32, False, 32), (64, 512, 128, True, 64), (300, 384, 64, False, 128), (520, 1024, 128, False, 512)]


def _tensor_dtypes(device: str) -> tuple[torch.dtype, ...]:
    # bf16 tensor-core operands only on the GPU: Triton 3.9's interpreter multiplies bf16 dot operands as their
    # raw bits (a 16 x 16 bf16 tl.dot alone is off by ~2.5e10 there, fp16 exact)
    return (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,)


def check_kernels(device: str) -> None:
    """The GEMV, the dequantise kernel and the prefill GEMM against the reference on `device` (called in the
    interpreter on CPU and compiled on CUDA)."""
    for check in KERNEL_CHECKS:
        check(device)


def check_gemv(device: str) -> None:
    """Each case's dequantise, GEMV (every loop and arithmetic form, empty splits included) and prefill GEMM."""
    tensor_dtypes = _tensor_dtypes(device)
    default_prefetch, default_loop = it.PREFETCH, it.LOOP
    for seed, (n, k, group, mins, tile_n) in enumerate(CASES):
        w = _weights(n, k, group, mins, seed)
        codes, sb = it.pack(w["q"], w["scales"], zeros=w.get("zeros"), mins=w.get("mins"), tile_n=tile_n)
        codes, sb = codes.to(device), sb.to(device)
        ref = _reference(w).to(device)
        assert torch.allclose(it.int4_dequant(codes, sb, n, group, torch.float32), ref, rtol=2e-7, atol=0), (n, k, group)
        # one rounding to bf16 of the fp32 value: to nearest on the GPU, toward zero in the interpreter
        # (Triton 3.9's CPU cast), so within one bf16 step
        assert torch.allclose(it.int4_dequant(codes, sb, n, group, torch.bfloat16).float(), ref, rtol=2 ** -7, atol=0)
        for m, dtype, split in ((1, torch.bfloat16, 1), (3, torch.float32, 3), (2, torch.float16, 2), (1, torch.float32, 4)):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m)).to(device=device, dtype=dtype)
            want = x.double() @ ref.double().T
            # both loops (the next step's codes loaded ahead or not), both forms of the arithmetic (LOOP); empty
            # splits included
            for prefetch, loop in ((0, "planes"), (1, "planes"), (0, "chain"), (1, "chain")):
                it.PREFETCH, it.LOOP = prefetch, loop
                got = it.int4_gemv(x, codes, sb, n, group, split).sum(0)
                err = float((got.double() - want).norm() / want.norm())
                assert err < 1e-6, (n, k, group, m, dtype, split, prefetch, loop, err)  # fp32 rounding: exact products
            it.PREFETCH, it.LOOP = default_prefetch, default_loop
        default_mm = it.MM_CONFIG
        for m in (5, 130):  # the GEMM with the dequantise inside (prefill rows): operands in x's dtype, fp32 sums
            for dtype in tensor_dtypes:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m)).to(device=device, dtype=dtype)
                want = x.double() @ ref.double().T
                # both orientations (the weight as the register or the shared-memory operand), both dequantise
                # routes (I2F), a tile past M and N; split-K (the partial sums added atomically in fp32) in three,
                # the last split shorter where the steps do not divide
                forms = ((default_mm, 0), ((64, 64, 4, 2, 2, 1, 1), 0), ((64, 64, 4, 2, 2, 0, 0), 0),
                         ((64, 64, 4, 2, 2, 1, 0), 3), ((64, 64, 4, 2, 2, 0, 1), 3))
                if device == "cpu" and n * k > 300 * 384:  # the largest case in the interpreter (17 of its 57 s
                    forms = forms[:1] + forms[3:4]  # in all five forms): the default and a split of uneven steps
                for it.MM_CONFIG, it.MM_SPLIT in forms:
                    got = it.int4_mm(x, codes, sb, n, group)
                    assert got.shape == (m, n) and got.dtype == dtype
                    err = float((got.double() - want).norm() / want.norm())
                    assert err < (2 ** -7 if dtype == torch.bfloat16 else 2 ** -9), (n, k, group, m, dtype,
                                                                                      it.MM_CONFIG, it.MM_SPLIT, err)
        it.MM_CONFIG, it.MM_SPLIT = default_mm, 0


def check_layer_and_split_k(device: str) -> None:
    """A layer's dequantise in one launch, and the split-K sum inside the GEMV."""
    tensor_dtypes = _tensor_dtypes(device)
    default_prefetch, default_loop = it.PREFETCH, it.LOOP
    # one launch for up to four weights (a prefill's layer): each the same values as its own dequantise, bit for bit
    packed = []
    for seed, (n, k, group, mins, tile_n) in enumerate(CASES[:3]):
        w = _weights(n, 512, 32, mins, seed + 20)
        codes, sb = it.pack(w["q"], w["scales"], zeros=w.get("zeros"), mins=w.get("mins"), tile_n=tile_n)
        packed.append((codes.to(device), sb.to(device), n))
    packed.append(packed[0])
    for count in (1, 2, 4):
        for dtype in (torch.float32, tensor_dtypes[0]):
            outs = it.dequant_many(packed[:count], 32, dtype)
            assert len(outs) == count
            for (codes, sb, n), out in zip(packed, outs):
                assert out.dtype == dtype and torch.equal(out, it.int4_dequant(codes, sb, n, 32, dtype)), (count, n)
    with pytest.raises(ValueError, match="1 to 4 weights"):
        it.dequant_many(packed + packed[:1], 32, torch.float32)
    # the split-K sum inside the kernel, both modes: same numbers, scratch left zeroed (so a second call and a
    # graph replay see it as the first did), and the "last" mode's sum in split order repeats bit for bit
    for seed, (n, k, group, mins, tile_n) in enumerate(CASES):
        w = _weights(n, k, group, mins, seed)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w.get("zeros"), mins=w.get("mins"),
                                                   tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        ref = _reference(w).to(device)
        shapes = ((1, torch.float32, 1), (3, torch.float32, 4), (2, torch.bfloat16, 2), (1, torch.float32, 16))
        for c, (mode, prefetch, loop) in enumerate(((1, 0, "planes"), (2, 0, "planes"), (1, 1, "planes"),
                                                    (2, 1, "planes"), (1, 0, "chain"), (1, 1, "chain"))):
            it.PREFETCH, it.LOOP = prefetch, loop
            # compiled on a GPU: every shape; in the interpreter (CI, ~2/3 of this test's 4 min there) two of the four,
            # alternating with the case and the form, so each form still meets every shape over the four cases
            for i, (m, dtype, split) in enumerate(shapes if device == "cuda" else shapes[(seed + c) % 2::2]):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m)).to(device=device, dtype=dtype)
                want = x.double() @ ref.double().T
                got = it.int4_gemv_reduced(x, codes, sb, ws, cnt, n, group, split, mode)
                assert got.shape == (m, n) and got.dtype == dtype
                err = float((got.double() - want).norm() / want.norm())
                assert err < (1e-6 if dtype == torch.float32 else 2 ** -8), (n, k, mode, loop, m, dtype, split, err)
                assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0, (mode, split)
                if device == "cuda" or i == 0:  # a second call sees the scratch as the first did
                    again = it.int4_gemv_reduced(x, codes, sb, ws, cnt, n, group, split, mode)
                    if mode == 2 or device == "cpu":  # the interpreter runs programs in order: atomics too
                        assert torch.equal(again, got), (mode, split)
        it.PREFETCH, it.LOOP = default_prefetch, default_loop
    with pytest.raises(ValueError, match="rows and mode"):
        it.int4_gemv_reduced(torch.zeros(it.GEMV_MAX_M + 1, 256, device=device), codes, sb, ws, cnt, n, 128, 1, 1)


def check_entries(device: str) -> None:
    """int8 activations, an activation spanning many orders of magnitude, and the public entry `linear` in every
    reduce and prefill mode."""
    tensor_dtypes = _tensor_dtypes(device)
    check_act8(device, CASES)
    # activations over ~40 orders of magnitude of 2 (an outlier channel, tiny values): still fp32-exact products
    w = _weights(64, 256, 32, False, 9)
    codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=32))
    x = torch.randn(1, 256) * torch.logspace(-12, 8, 256)
    x[0, 7] = 3.0e4
    x = x.to(device)
    want = x.double() @ _reference(w).double().to(device).T
    got = it.int4_gemv(x, codes, sb, 64, 32, 2).sum(0)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    # through the public entry: GEMV rows and the dequantise + F.linear path (more than GEMV_MAX_M rows)
    ws, cnt = it.scratch(64, codes)
    default = it.REDUCE
    for mode in it.REDUCE_MODES:
        it.REDUCE = mode
        for m in (1, it.GEMV_MAX_M + 3):
            x = torch.randn(m, 256, device=device)
            got = it.linear(x, codes, sb, 64, 32, 2, ws, cnt)
            want = x @ _reference(w).to(device).T
            assert got.shape == (m, 64) and got.dtype == x.dtype
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (mode, m, float((got - want).abs().max()))
    it.REDUCE = default
    default = it.PREFILL
    for mode in it.PREFILL_MODES:  # both prefill forms through the public entry, fp32 rows on the dequantise path
        it.PREFILL = mode
        for dtype in (tensor_dtypes[0], torch.float32):
            x = torch.randn(it.GEMV_MAX_M + 3, 256, device=device).to(dtype)
            got = it.linear(x, codes, sb, 64, 32, 2)
            want = x.double() @ _reference(w).double().to(device).T
            assert got.dtype == dtype and float((got.double() - want).norm() / want.norm()) < 2 ** -7, (mode, dtype)
    # "graphed": a second weight of the same shape shares the scratch and has its own graph; each replays its own
    w2 = _weights(64, 256, 32, False, 5)
    codes2, sb2 = (t.to(device) for t in it.pack(w2["q"], w2["scales"], zeros=w2["zeros"], tile_n=32))
    it.PREFILL = "graphed"
    x = torch.randn(it.GEMV_MAX_M + 3, 256, device=device).to(tensor_dtypes[0])
    for _ in range(2):
        for c, s_b, ww in ((codes, sb, w), (codes2, sb2, w2)):
            got = it.linear(x, c, s_b, 64, 32, 2)
            want = x.double() @ _reference(ww).double().to(device).T
            assert float((got.double() - want).norm() / want.norm()) < 2 ** -7
    it.PREFILL = default


def check_act8(device: str, cases: list[tuple[int, int, int, bool, int]]) -> None:
    """int8 activations on dp4a (ACT "int8"): act8_quant quantises as llama.cpp's Q8_1 (d = max |x| / 127 a 32-column
    block, codes rounded to nearest), the GEMV is exact (fp32 rounding) given those codes, and `linear` takes that
    path when ACT says so and the split-K sum is in the kernel."""
    for seed, (n, k, group, mins, tile_n) in enumerate(cases):
        w = _weights(n, k, group, mins, seed)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w.get("zeros"), mins=w.get("mins"),
                                                   tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        sbn = it.unpack_sb(sb, n).double()  # (N, G, 2): s and b as the kernel reads them
        gi = torch.arange(k, device=device) // group
        wq = w["q"].to(device).double() * sbn[..., 0][:, gi]  # q * s, without b
        for m in (1, 3):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m))
            x[:, 5] *= 40.0  # an outlier column: its block's scale is its own
            x[0, 32:64] = 0.0  # an all-zero block: d = 0, codes 0
            x = x.to(device=device, dtype=torch.bfloat16)
            q = it.act8_quant(x)
            assert q.shape == (m, it.act8_width(k)) and q.dtype == torch.int8
            qc, dd, ss = it.act8_unpack(q)
            qc = qc.float()
            xd = torch.stack([dd, ss], dim=-1)
            blocks = x.float().reshape(m, k // 32, 32)
            amax = blocks.abs().amax(-1)
            assert torch.allclose(xd[..., 0], amax / 127, rtol=1e-6, atol=0)
            assert torch.allclose(xd[..., 1], blocks.sum(-1), rtol=1e-5, atol=1e-5)
            want_q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)[..., None]).reshape(m, k)
            assert float((qc - want_q).abs().max()) <= 1 and float((qc != want_q).float().mean()) < 0.01
            assert int(qc[0, 32:64].abs().sum()) == 0 and float(xd[0, 1, 0]) == 0
            xdeq = (qc.reshape(m, k // 32, 32) * xd[..., :1]).reshape(m, k).double()
            want = xdeq @ wq.T + x.double().reshape(m, k // group, group).sum(-1) @ sbn[..., 1].T
            exact = x.double() @ _reference(w).double().to(device).T
            for split, mode in ((1, 1), (4, 1), (2, 2)):
                got = it.int4_gemv_a8(q, codes, sb, ws, cnt, n, group, split, mode, torch.float32)
                assert got.shape == (m, n) and got.dtype == torch.float32
                err = float((got.double() - want).norm() / want.norm())
                assert err < 1e-6, (n, k, group, m, split, mode, err)
                assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0, (mode, split)
                # the activation's rounding to 8 bits a block, against the exact product (bf16 x): ~1 %
                assert float((got.double() - exact).norm() / exact.norm()) < 0.03, (n, k, group, m, split)
            default = it.ACT
            it.ACT = "int8"
            y = it.linear(x, codes, sb, n, group, 4, ws, cnt)
            assert y.dtype == torch.bfloat16 and float((y.double() - want).norm() / want.norm()) < 2 ** -8
            it.ACT = default


def check_act16(device: str, cases: list[tuple[int, int, int, bool, int]] = CASES[:2]) -> None:
    """int16 activations (ACT "int16"): act8_quant(x, 16) takes each 32-column block on d = 2^(e - 14), e the
    exponent of its largest |x|, so every bf16 value within 2^7 of that is its code times d exactly and every
    other within d / 2; given the codes the GEMV is exact (fp32 rounding), so against the bf16 product it is as
    close as fp32 arithmetic; and `linear` takes that path when ACT says "int16"."""
    for seed, (n, k, group, mins, tile_n) in enumerate(cases):
        w = _weights(n, k, group, mins, seed)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w.get("zeros"), mins=w.get("mins"),
                                                   tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        for m in (1, 3):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m))
            x[:, 5] *= 300.0  # an outlier column: its block's other values are far below it
            x[0, 32:64] = 0.0  # an all-zero block: d = 0, codes 0
            x[:, 64:96] *= 1e-30  # tiny values: d far below fp32's normals would need; the smallest normal's
            x = x.to(device=device, dtype=torch.bfloat16)
            q = it.act8_quant(x, 16)
            assert q.shape == (m, it.act8_width(k, 16)) == (m, 9 * k // 4) and q.dtype == torch.int8
            # with a weight (a decode step's first q/k/v input, h times the norm's weight): the codes of torch's
            # rounded product, bit for bit (fp32 in the interpreter, whose cast to bf16 rounds toward zero)
            xw = x if device == "cuda" else x.float()
            g = torch.randn(k, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=xw.dtype)
            for bits in (8, 16):
                assert torch.equal(it.act8_quant(xw, bits, weight=g),
                                   it.act8_quant((xw.float() * g.float()).to(xw.dtype), bits)), bits
            with pytest.raises(ValueError, match="weight must be contiguous"):
                it.act8_quant(xw, 16, weight=g[:64])
            assert it.act8_bits(q.shape[1], k) == 16 and it.act8_bits(it.act8_width(k), k) == 8
            qc, dd, ss = it.act8_unpack(q, 16)
            blocks = x.float().reshape(m, k // 32, 32)
            amax = blocks.abs().amax(-1)
            _, e = torch.frexp(amax)  # amax = f 2^e, f in [0.5, 1)
            want_d = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), (e - 15).clamp(min=-126)), 0)
            assert torch.equal(dd, want_d)
            assert torch.allclose(ss, blocks.sum(-1), rtol=1e-5, atol=1e-30)
            assert int(qc.abs().max()) <= 32767 and int(qc[0, 32:64].abs().sum()) == 0
            back = (qc.reshape(m, k // 32, 32).double() * dd[..., None].double())
            err = (back - blocks.double()).abs()
            near = blocks.abs() >= amax[..., None] / 128
            assert float(err[near].max()) == 0.0  # exact within 2^7 of the block's largest
            assert bool((err <= dd[..., None].double() / 2).all())
            sbn = it.unpack_sb(sb, n).double()
            gi = torch.arange(k, device=device) // group
            wq = w["q"].to(device).double() * sbn[..., 0][:, gi]
            want = back.reshape(m, k) @ wq.T + x.double().reshape(m, k // group, group).sum(-1) @ sbn[..., 1].T
            exact = x.double() @ _reference(w).double().to(device).T
            for split, mode in ((1, 1), (4, 1), (2, 2)):
                got = it.int4_gemv_a8(q, codes, sb, ws, cnt, n, group, split, mode, torch.float32)
                assert got.shape == (m, n) and float((got.double() - want).norm() / want.norm()) < 1e-6
                assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0, (mode, split)
                # against the bf16 activation's own product: fp32 rounding, not the 1 % of 8-bit codes
                # against the bf16 activation's own product: ~5e-5 here, where the 300x outlier's block rounds its
                # other values to d / 2 (int8 codes: ~1e-2)
                assert float((got.double() - exact).norm() / exact.norm()) < 2e-4, (n, k, group, m, split)
            default = it.ACT
            y_exact = it.linear(x, codes, sb, n, group, 4, ws, cnt)
            it.ACT = "int16"
            y = it.linear(x, codes, sb, n, group, 4, ws, cnt)
            it.ACT = default
            # bf16 outputs (rounding up to 2^-8 of each value): against the product given the codes, and the same
            # rows the exact path gives
            assert y.dtype == torch.bfloat16 and float((y.double() - want).norm() / want.norm()) < 2 ** -7
            assert float((y.double() - y_exact.double()).norm() / y_exact.double().norm()) < 2 ** -7
    with pytest.raises(ValueError, match="no ACT8_FORMAT row"):
        it.act8_bits(3 * 256, 256)


def check_epilogue_codes(device: str) -> None:
    """int4_gemv_epilogue_a8 (quantised activations, the epilogue writing the next GEMV's codes): given a float x it
    gives int4_gemv_epilogue's y, given x's codes the same within their rounding, and its codes are act8_quant's
    of what the float epilogue hands on (y * next_weight; with SiLU, y), codes and scales bit for bit, for 8 and 16
    bits, on a weight of uneven tiles (N = 320 over 128-row tiles: the last tile's rows past N are not codes).
    In fp32 in the interpreter, whose cast to bf16 rounds toward zero where torch's rounds to nearest."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for n, tile_n, silu in ((320, 128, False), (256, 64, True)):
        k, group = 256, 32
        w = _weights(n, k, group, False, n)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(2, k, generator=gen).to(device=device, dtype=dt)
        h = (torch.randn(2, k, generator=gen) * 3).to(device=device, dtype=dt)
        res = torch.randn(2, n, generator=gen).to(device=device, dtype=dt)
        g = (torch.rand(n, generator=gen) + 0.5).to(device=device, dtype=dt)
        kw = {"residual": None, "next_weight": None, "rms_of": h, "silu": True} if silu else {
            "residual": res, "next_weight": g, "rms_of": None, "silu": False}
        for bits in (8, 16):
            for split in (1, 3) if device == "cuda" else (3,):
                q = it.act8_quant(x, bits)
                for xin in (x, q):
                    y, xq = it.int4_gemv_epilogue_a8(xin, codes, sb, ws, cnt, n, group, split, 1, kw["residual"],
                                                     kw["next_weight"], kw["rms_of"], 1e-5, silu, bits, dt)
                    assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0
                    want_y, _ = it.int4_gemv_epilogue(x.float(), codes, sb, ws, cnt, n, group, split, 1,
                                                      *(None if t is None else t.float() for t in (
                                                          kw["residual"], kw["next_weight"], kw["rms_of"])),
                                                      1e-5, silu)
                    assert y.dtype == dt and y.shape == want_y.shape
                    tol = 0.03 if xin is q and bits == 8 else 2 ** -7  # int8 codes: ~1 % (check_act8)
                    assert float((y.double() - want_y.double()).norm() / want_y.double().norm()) < tol
                    handed = y if silu else (y.float() * g.float()).to(dt)  # as the kernel rounds it
                    want_q = it.act8_quant(handed, bits)
                    assert xq.shape == want_q.shape == (2, it.act8_width(n // 2 if silu else n, bits))
                    (gc, gd, gs), (wc, wd, wsum) = it.act8_unpack(xq, bits), it.act8_unpack(want_q, bits)
                    assert torch.equal(gc, wc) and torch.equal(gd, wd), (n, bits, split)
                    assert torch.allclose(gs, wsum, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        w = _weights(160, 128, 32, False, 3)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=32))
        it.int4_gemv_epilogue_a8(torch.zeros(1, 128, device=device), codes, sb, *it.scratch(160, codes), 160, 32, 1,
                                 1, None, torch.ones(160, device=device), None, 1e-5, False, 16, torch.float32)


def check_rope_epilogue(device: str) -> None:
    """int4_gemv_rope (RoPE and the cache write in the fused q/k/v GEMV's epilogue) against the GEMV's epilogue
    followed by kernels.rope_triton.rope_write, bit for bit: q rotated in y, k rotated and v copied into the caches at
    each row's slot and nowhere else, k and v unrotated in y; tiles of one head and of two, one split and several,
    float activations and 16-bit codes; the scratch left zeroed; a tile that cuts a head is refused."""
    from kernels.rope_triton import rope_write

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv, hd, k, group, m = 4, 2, 32, 256, 32, 2
    n = (heads + 2 * kv) * hd
    gen = torch.Generator().manual_seed(5)
    w = _weights(n, k, group, False, 11)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dt)
    h = (torch.randn(m, k, generator=gen) * 2).to(device=device, dtype=dt)
    ang = torch.rand(m, hd // 2, generator=gen) * 6
    cos, sin = (torch.cat((f, f), -1).to(device=device, dtype=dt) for f in (ang.cos(), ang.sin()))
    pos = torch.tensor([5, 9], device=device)
    for tile_n in (32, 64):
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        for split in (1, 3):
            for bits, xin in ((8, x), (16, it.act8_quant(x, 16))):
                caches = [torch.zeros(3, kv, 16, hd, device=device, dtype=dt) for _ in range(4)]
                y = it.int4_gemv_rope(xin, codes, sb, ws, cnt, n, group, split, 1, h, 1e-5, cos, sin, pos, caches[0],
                                      caches[1], heads, bits, dt)
                assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0
                want, _ = it.int4_gemv_epilogue_a8(xin, codes, sb, ws, cnt, n, group, split, 1, None, None, h, 1e-5,
                                                   False, bits, dt)
                q = rope_write(want[:, :heads * hd], want[:, heads * hd:(heads + kv) * hd],
                               want[:, (heads + kv) * hd:], cos, sin, pos, caches[2], caches[3])
                assert torch.equal(y[:, :heads * hd].reshape(q.shape), q), (tile_n, split, bits)
                assert torch.equal(y[:, heads * hd:], want[:, heads * hd:])
                assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
                assert int((caches[0] != 0).sum()) == m * kv * hd  # each row's slot, nothing else
    codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=32))
    with pytest.raises(ValueError, match="whole heads"):  # head_dim 64 over tiles of 32 rows
        it.int4_gemv_rope(x, codes, sb, *it.scratch(n, codes), n, group, 1, 1, None, 1e-5, cos, sin, pos,
                          torch.zeros(3, 1, 16, 64, device=device, dtype=dt),
                          torch.zeros(3, 1, 16, 64, device=device, dtype=dt), 2, 8, dt)


def check_epilogues(device: str) -> None:
    """int4_gemv_epilogue's four epilogues (residual add and the next norm's input; the norm's scale; SiLU(gate) * up
    over tile pairs, with the norm's scale) against the same arithmetic in float64 on the kernel's own product, both
    in-kernel sums, one split and several, one row and several; the scratch is left zeroed (pair counters included),
    so a second call gives the same; bad shapes are refused."""
    for seed, (n, k, group, tile_n) in enumerate(((256, 256, 32, 64), (512, 384, 128, 128))):
        w = _weights(n, k, group, False, seed + 40)
        codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=tile_n))
        ws, cnt = it.scratch(n, codes)
        ref = _reference(w).double().to(device)
        gen = torch.Generator().manual_seed(seed)
        for m, dtype, split, mode in ((1, torch.float32, 1, 1), (3, torch.float32, 4, 1), (2, torch.float32, 2, 2),
                                      (1, torch.bfloat16, 4, 1))[seed::2] if device == "cpu" else (
                (1, torch.float32, 1, 1), (3, torch.float32, 4, 1), (2, torch.float32, 2, 2), (1, torch.bfloat16, 4, 1),
                (4, torch.bfloat16, 1, 2)):
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7

            def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
                assert got.dtype == dtype and got.shape == want.shape, (what, got.shape, want.shape)
                err = float((got.double() - want).norm() / want.norm())
                assert err < tol, (what, n, m, split, mode, dtype, err)

            def run(x: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
                args = {"residual": None, "next_weight": None, "rms_of": None, "eps": 1e-5, "silu": False} | kw
                out = it.int4_gemv_epilogue(x, codes, sb, ws, cnt, n, group, split, mode, **args)
                assert int(cnt.abs().sum()) == 0 and float(ws.abs().sum()) == 0, (kw.keys(), split, mode)
                return out

            x = (torch.randn(m, k, generator=gen) * 3).to(device=device, dtype=dtype)
            res = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype)
            g = (torch.rand(n, generator=gen) + 0.5).to(device=device, dtype=dtype)
            prod = x.double() @ ref.T
            # the residual add and the next norm's input (xg from y as it was rounded)
            y, xg = run(x, residual=res, next_weight=g)
            close(y, prod + res.double(), "residual")
            close(xg, y.double() * g.double(), "next norm's input")
            assert torch.equal(run(x, residual=res, next_weight=g)[0], y) or device == "cuda"
            # the norm's scale: x is h * weight, the product comes out times 1 / rms(h)
            h = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype) * 4
            inv = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5)
            y, none = run(x, rms_of=h)
            assert none.numel() == 0
            close(y, prod * inv, "norm")
            # SiLU(gate) * up, the gates the first half of the rows, with and without the norm's scale
            for scale in (None, h):
                y, _ = run(x, rms_of=scale, silu=True)
                p = prod * (inv if scale is not None else 1)
                gate, up = p[:, :n // 2], p[:, n // 2:]
                close(y, torch.nn.functional.silu(gate) * up, f"silu, norm {scale is not None}")
                again, _ = run(x, rms_of=scale, silu=True)
                assert device == "cuda" or torch.equal(again, y)
        with pytest.raises(ValueError, match="SiLU epilogue"):
            it.int4_gemv_epilogue(x, codes, sb, ws, cnt, n, group, 1, 1, res, None, None, 1e-5, True)
        with pytest.raises(ValueError, match="residual must be contiguous"):
            it.int4_gemv_epilogue(x, codes, sb, ws, cnt, n, group, 1, 1, res[:, :8], None, None, 1e-5, False)
    check_epilogue_codes(device)
    check_rope_epilogue(device)
    w = _weights(192, 128, 32, False, 7)  # 192 rows: 3 tiles of 64, no pairs
    codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=64))
    assert not it.silu_pairs(192, 64) and it.silu_pairs(256, 64)
    with pytest.raises(ValueError, match="N=192"):
        it.int4_gemv_epilogue(torch.zeros(1, 128, device=device), codes, sb, *it.scratch(192, codes), 192, 32, 1, 1,
                              None, None, None, 1e-5, True)


# the parts of check_kernels, which the interpreter test runs as processes side by side
KERNEL_CHECKS = (check_gemv, check_layer_and_split_k, check_entries, check_act16, check_epilogues)


def check_compile(device: str) -> None:
    """The custom ops under torch.compile(fullgraph=True): no graph break, same numbers as eager."""
    w = _weights(64, 256, 32, False, 3)
    codes, sb = (t.to(device) for t in it.pack(w["q"], w["scales"], zeros=w["zeros"], tile_n=32))

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(it.linear(x, codes, sb, 64, 32, 2)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for m in (1, 6):
        x = torch.randn(m, 256, device=device)
        assert torch.allclose(compiled(x), f(x), atol=1e-5), m
    ws, cnt = it.scratch(64, codes)  # the in-kernel split-K sum traces whole too, and repeats under the compiled call

    def g(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(it.linear(x, codes, sb, 64, 32, 2, ws, cnt)) * 2

    default = it.REDUCE
    for mode in ("atomic", "last"):
        it.REDUCE = mode
        torch._dynamo.reset()
        compiled = torch.compile(g, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
        x = torch.randn(1, 256, device=device)
        for _ in range(2):
            assert torch.allclose(compiled(x), f(x), atol=1e-5), mode
    it.REDUCE = default
    default = it.ACT  # int8 activations: the quantise and the dp4a GEMV trace whole too
    it.ACT = "int8"
    torch._dynamo.reset()
    compiled = torch.compile(g, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    x = torch.randn(1, 256, device=device)
    assert torch.allclose(compiled(x), g(x), rtol=1e-5, atol=1e-6)
    assert torch.allclose(compiled(x), f(x), rtol=0.05, atol=0.05)  # int8 activations: ~1 % off exact
    it.ACT = "int16"  # and int16 ones (the bits a traced argument of the quantise)
    torch._dynamo.reset()
    compiled = torch.compile(g, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.allclose(compiled(x), g(x), rtol=1e-5, atol=1e-6)
    assert float((compiled(x) - f(x)).norm() / f(x).norm()) < 1e-4  # fp32 x: its 16-bit codes, ~2e-5 off exact
    it.ACT = default
    nw = torch.linspace(0.5, 1.5, 64, device=device)  # the epilogues: optional tensors, two outputs, traced whole

    def e(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        y, xg = it.int4_gemv_epilogue(x, codes, sb, ws, cnt, 64, 32, 2, 1, res, nw, None, 1e-5, False)
        act, none = it.int4_gemv_epilogue(x, codes, sb, ws, cnt, 64, 32, 2, 1, None, None, x, 1e-5, True)
        return torch.cat([y, xg, act, none.reshape(1, 0).expand(1, 0)], -1)

    torch._dynamo.reset()
    compiled = torch.compile(e, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    x, res = torch.randn(1, 256, device=device), torch.randn(1, 64, device=device)
    for _ in range(2):
        assert torch.allclose(compiled(x, res), e(x, res), atol=1e-5)

    def e16(x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, ...]:  # codes in and out, a dtype argument
        y, xq = it.int4_gemv_epilogue_a8(it.act8_quant(x, 16), codes, sb, ws, cnt, 64, 32, 2, 1, res, nw, None, 1e-5,
                                         False, 16, torch.float32)
        return y, xq

    torch._dynamo.reset()
    compiled = torch.compile(e16, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for _ in range(2):
        (cy, cq), (ey, eq) = compiled(x, res), e16(x, res)
        assert torch.allclose(cy, ey, atol=1e-5) and cq.shape == eq.shape == (1, it.act8_width(64, 16))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.interpreter(*(f"from tests.test_int4_triton import {f.__name__}; {f.__name__}('cpu')"
                           for f in (*KERNEL_CHECKS, check_compile)), timeout=300)
def test_int4_kernels_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run_marked(request)


@pytest.mark.cuda
def test_int4_epilogues_cuda() -> None:
    check_epilogues("cuda")


@pytest.mark.cuda
def test_int4_kernels_cuda() -> None:
    check_kernels("cuda")
    check_compile("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_gemv_epilogues_compile_for_orin_and_hopper(arch: int) -> None:
    """The GEMV with each epilogue (int4_gemv_epilogue) compiles to SASS for sm_87 (Orin) and sm_90 without a GPU,
    at Llama-3-8B's gate/up shape as the model launches it, with no spills to the stack and the plain GEMV's
    registers at most (the epilogue runs after the loop); and the step's first quantise with the norm's weight."""
    from scripts.kv_kernel_sass import compile_kernel, resources

    n, k = 28672, 4096
    warps, split, _ = it.gemv_config(n, k, 132)
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "sb_ptr": "*fp16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32", "res_ptr": "*bf16", "g_ptr": "*bf16", "xg_ptr": "*bf16", "h_ptr": "*bf16",
            "ss_ptr": "*fp32", "eps": "fp32"}
    consts = {"GROUP": 128, "TN": it.tile_rows(n), "SPLIT": split, "MODE": 1, "CH": min(it.REDUCE_CHUNK, split),
              "STAGES": 1, "PREFETCH": 0, "UNROLL": 1, "ASM": True}
    plain = {mode: resources(compile_kernel(it._gemv_reduced_kernel, ptrs, {**consts, "MODE": mode}, arch, warps, 1))
             for mode in (1, 2)}
    for epi in ({"RES": True, "XG": True}, {"NORM": True}, {"NORM": True, "SILU": True}, {"SILU": True, "MODE": 2}):
        got = resources(compile_kernel(it._gemv_reduced_kernel, ptrs, {**consts, **epi}, arch, warps, 1))
        want = plain[epi.get("MODE", 1)]
        assert got["stack_bytes"] == 0 and got["registers"] <= want["registers"], (arch, epi, got, want)
    # int16 activations with the epilogues writing the next GEMV's codes (int4_gemv_epilogue_a8): the tile's 512 rows
    # quantised in the last program; no spills, and at most the exact GEMV's 96 registers on sm_87 (80-88 measured
    # with Triton 3.9, the int16 GEMV without an epilogue 80-84), so a program's occupancy is not below the default's
    a16 = {**consts, "ACT8": True, "BITS": 16}
    p16 = {**ptrs, "x_ptr": "*i32", "xg_ptr": "*i8"}
    base = resources(compile_kernel(it._gemv_reduced_kernel, p16, a16, arch, warps, 1))
    for epi in ({"RES": True, "XG": True, "XQ": True}, {"NORM": True, "SILU": True, "XQ": True}):
        got = resources(compile_kernel(it._gemv_reduced_kernel, p16, {**a16, **epi}, arch, warps, 1))
        assert got["stack_bytes"] == 0 and got["registers"] <= 96, (arch, epi, got, base)
    # RoPE and the cache write in the q/k/v GEMV's epilogue (int4_gemv_rope), at Llama-3-8B's q/k/v shape: tiles of
    # 4 heads of 128 rows, with the norm's scale, bf16 and int16 activations; no spills, within the same 96
    n = 6144
    warps, split, _ = it.gemv_config(n, k, 132)
    rope = {"NORM": True, "ROPE": True, "HD": 128, "TN": it.tile_rows(n), "SPLIT": split,
            "CH": min(it.REDUCE_CHUNK, split)}
    rptr = {"cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64", "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    for c, p in (({**consts, **rope}, {**ptrs, **rptr}), ({**a16, **rope}, {**p16, **rptr})):
        got = resources(compile_kernel(it._gemv_reduced_kernel, p, c, arch, warps, 1))
        assert got["stack_bytes"] == 0 and got["registers"] <= 96, (arch, got)
    # o_proj's GEMV merging the attention's split partials (int4_gemv_merge) at Llama-3-8B's o shape: 32 heads of
    # 128 columns, 16 splits; with the residual / next-weight epilogue, y's product out as bf16 or as int16 codes; no
    # spills, within the same 96 registers
    n = 4096
    warps, split, _ = it.gemv_config(n, k, 132)
    mrg = {"MERGE": True, "BLOCK_S": 16, "MHD": 128, "TN": it.tile_rows(n), "SPLIT": split,
           "CH": min(it.REDUCE_CHUNK, split), "RES": True, "XG": True}
    mptr = {**ptrs, "mo_ptr": "*fp32", "mm_ptr": "*fp32", "ml_ptr": "*fp32", "NSPL": "i32", "MNH": "i32"}
    for extra, p in (({}, mptr), ({"XQ": True, "BITS": 16}, {**mptr, "xg_ptr": "*i8"})):
        got = resources(compile_kernel(it._gemv_reduced_kernel, p, {**consts, **mrg, **extra}, arch, warps, 1))
        assert got["stack_bytes"] == 0 and got["registers"] <= 96, (arch, extra, got)
    # the decode step's first codes, of the embedding times the first norm's weight (act8_quant's weight), fp16 as
    # Orin's models run and bf16: no spills
    for dt in ("*fp16", "*bf16"):
        got = resources(compile_kernel(it._act8_kernel, {"x_ptr": dt, "q_ptr": "*i8", "w_ptr": dt},
                                       {"NB": it.ACT8_BLOCKS, "BITS": 16, "HAS_W": True}, arch, 4, 1))
        assert got["stack_bytes"] == 0, (arch, dt, got)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
@pytest.mark.parametrize("arch", [87, 90])
def test_prefill_gemm_compiles_for_orin_and_hopper(arch: int) -> None:
    """The GEMM with the dequantise inside (int4_mm) compiles to SASS for sm_87 (Orin) and sm_90 without a GPU in
    both orientations, with no spills, on tensor cores (HMMA / Hopper's HGMMA), and with the activation, the codes
    and the (s, b) words copied to shared memory ahead of use (LDGSTS: cp.async), not loaded in line."""
    import re

    from scripts.kv_kernel_sass import compile_kernel, cuobjdump, resources

    for bm, bn, warps, stages, gm, swap, i2f in (it.mm_config(it.MM_SMALL_M, arch // 10), it.mm_config(512, arch // 10),
                                                 (128, 128, 8, 3, 8, 1, 1), (128, 128, 8, 3, 8, 0, 0)):
        split = 1 if (bm, bn) == (128, 128) else 2  # split-K: the sums added into an fp32 y
        ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "sb_ptr": "*i32", "y_ptr": "*fp32" if split > 1 else "*bf16"}
        consts = {"GROUP": 128, "TN": 512, "BM": bm, "BN": bn, "STAGES": stages, "GM": gm, "SWAP": bool(swap),
                  "I2F": bool(i2f), "SPLIT": split}
        kern = compile_kernel(it._mm_kernel, ptrs, consts, arch, warps, stages)
        sass = cuobjdump(kern, "-sass")
        assert resources(kern)["stack_bytes"] == 0, (arch, swap)
        assert re.search(r"\bHGMMA\." if arch >= 90 else r"\bHMMA\.16816\.F32\.BF16", sass), (arch, swap)
        assert "LDGSTS" in sass and not re.search(r"LDG\.E\.U16", sass), (arch, swap)


def test_activation_mode_auto_takes_int16_codes_for_16_bit_models_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ACT "auto" (the default): int16 codes for a bf16 / fp16 model (bf16 values exact within 2^7 of their block's
    largest), the model's own activations for an fp32 one, whose values int16 codes would round; a set mode holds
    for every dtype. PDL's "auto" stays on for int16 and goes off only for int8 (what each measured)."""
    import os

    from kernels import pdl

    assert it.ACT == os.environ.get("ORIN_AGENT_INT4_ACT", "auto")
    monkeypatch.setattr(it, "ACT", "auto")
    assert [it.act_mode(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == ["int16", "int16", "exact"]
    assert [it.act_bits(d) for d in (torch.bfloat16, torch.float32)] == [16, 8]
    for mode, pdl_ok in (("auto", True), ("int16", True), ("exact", True), ("int8", False)):
        monkeypatch.setattr(it, "ACT", mode)
        assert pdl._measured_faster(1) == pdl_ok, mode
        if mode != "auto":
            assert it.act_mode(torch.bfloat16) == it.act_mode(torch.float32) == mode


def test_prefill_rule_takes_the_fused_gemm_up_to_mm_max_m(monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFILL "auto" (the default): tensor-core dtypes run int4_mm up to MM_MAX_M rows and dequantise once above
    (the crossover measured on an H100), fp32 always dequantises; a layer's weights are held dequantised only
    where the rule dequantises; the configs by M, and by the GPU's generation above MM_SMALL_M."""
    from kernels import weight_only

    assert it.PREFILL == "auto"
    cut = it.MM_MAX_M
    for mode, rows, dtype, fused in (("auto", cut, torch.bfloat16, True), ("auto", cut + 1, torch.bfloat16, False),
                                     ("auto", it.GEMV_MAX_M + 1, torch.float16, True),
                                     ("auto", cut, torch.float32, False), ("fused", 4 * cut, torch.bfloat16, True),
                                     ("dequant", it.GEMV_MAX_M + 1, torch.bfloat16, False)):
        monkeypatch.setattr(it, "PREFILL", mode)
        assert it.prefill_fused(rows, dtype) is fused, (mode, rows, dtype)
        layer = weight_only.QuantLinear.__new__(weight_only.QuantLinear)  # hold_prefill_weights' early exit only
        if fused:
            assert weight_only.hold_prefill_weights([layer], rows, dtype) == []
    monkeypatch.setattr(it, "MM_CONFIG", None)
    small = it.MM_SMALL_M
    assert it.mm_config(small) == it.MM_CONFIG_SMALL and it.mm_config(small + 1) == it.MM_CONFIG_LARGE
    assert it.mm_config(small + 1, 8) == it.MM_CONFIG_LARGE_SM80
    monkeypatch.setattr(it, "MM_CONFIG", (64, 64, 4, 2, 2, 0, 0))
    assert it.mm_config(1) == it.mm_config(4096) == (64, 64, 4, 2, 2, 0, 0)
    # split-K to about two programs an SM: Llama-3-8B down_proj (K 14336: 224 steps) at M = 128 in 128 x 64 blocks on
    # an H100 (64 blocks, 132 SMs), qkv (96 blocks); gate/up (448 blocks) and a short K not
    monkeypatch.setattr(it, "MM_SPLIT", 0)
    assert it.mm_split(64, 224, 132) == 4 and it.mm_split(96, 64, 132) == 2
    assert it.mm_split(448, 64, 132) == 1 and it.mm_split(1, 20, 132) == 1 and it.mm_split(8, 64, 132) == 4
    monkeypatch.setattr(it, "REDUCE", "last")  # repeatable sums: at most two partial sums added atomically
    assert it.mm_split(64, 224, 132) == 2 and it.mm_split(448, 64, 132) == 1
    monkeypatch.setattr(it, "MM_CONFIG", None)  # gate+up's 448 blocks of 128 x 64 at M = 128 take the wide tile
    assert it.mm_config(128, 9, 28672, 132) == it.MM_CONFIG_SMALL_WIDE and it.mm_config(128, 9, 6144, 132) == \
        it.MM_CONFIG_SMALL
