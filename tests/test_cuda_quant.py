"""GPU paths of the decode work (run on the lent GPU machine; skipped without CUDA): in-place cache
attention against the export formulation, the compiled graphed step against eager, and QuantLinear's
CUDA kernels (the Triton INT4 GEMV / dequantise ops, tinygemm INT4, int8dq, dense group-wise INT8) against the plain
dequantise-then-matmul, eager and inside the compiled decode step."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import int4_triton
from kernels.weight_only import QuantLinear, dequantize
from partition.checkpoint import load_model
from partition.quantize import QuantSpec, default_spec, quantize_checkpoint, quantize_model, quantize_weight
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner

pytestmark = pytest.mark.cuda


def _decode_both(a: TorchRunner, b: TorchRunner, prompt: int, steps: int, atol: float) -> None:
    ids = np.arange(1, prompt + 1, dtype=np.int32)[None] % 300
    pos = np.arange(prompt, dtype=np.int32)[None]
    assert torch.allclose(a.run(ids, pos).float(), b.run(ids, pos).float(), atol=atol)
    for step in range(steps):
        tok, p = np.array([[step + 3]], dtype=np.int32), np.array([[prompt + step]], dtype=np.int32)
        assert torch.allclose(a.run(tok, p).float(), b.run(tok, p).float(), atol=atol), step


def test_cuda_in_place_attention_matches_export_formulation(tiny_checkpoint: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(tiny_checkpoint, device="cuda")
    n = model.config.n_layers
    ref = TorchRunner(model, SliceSpec(0, n, n), 256, kv_in_place=False)
    fast = TorchRunner(model, SliceSpec(0, n, n), 256)
    assert fast.kv_in_place
    _decode_both(ref, fast, 40, 12, 1e-4)


def test_cuda_compiled_graph_step_matches_eager(tiny_checkpoint: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(tiny_checkpoint, device="cuda")
    n = model.config.n_layers
    eager = TorchRunner(model, SliceSpec(0, n, n), 256)
    compiled = TorchRunner(model, SliceSpec(0, n, n), 256, cuda_graphs=True, compile_decode=True)
    _decode_both(eager, compiled, 30, 8, 1e-3)


@pytest.mark.parametrize("bits,group,cuda_int4", [(4, 128, "triton"), (4, 32, "triton"), (4, 64, "triton"),
                                                  (4, 128, "tinygemm"), (4, 32, "tinygemm"), (8, -1, "triton"),
                                                  (8, 32, "triton")])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_cuda_quant_linear_matches_reference(bits: int, group: int, cuda_int4: str, rows: int) -> None:
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    spec = QuantSpec(bits, group, sym=bits == 8)
    q, s, z = quantize_weight(w, spec)
    gs = 1024 if group == -1 else group
    g = torch.arange(1024) // gs
    dev = [t.cuda() for t in (q, s, z, g)]
    fast = QuantLinear(*dev, bits, gs, dtype=torch.bfloat16, cuda_int4=cuda_int4)
    want_kernel = {"triton": "int4_triton" if int4_triton.available() else "int4pack", "tinygemm": "int4pack"}
    assert fast.kernel == (want_kernel[cuda_int4] if bits == 4 else "int8dq" if group == -1 else "dense")
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize(dev[0], dev[1].float(), dev[2], dev[3]).T
    got = fast(x).float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max(), (got - expected).abs().max()
    dq = fast.dequantized_weight()
    assert (dq - dequantize(dev[0], dev[1].float(), dev[2], dev[3])).abs().max() <= 0.01 * dq.abs().max()


def test_cuda_int4_float_mins_match_reference() -> None:
    """GGUF's Q4_1 form (w = q * s + m) through the Triton kernel and tinygemm."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (256, 512), generator=gen, dtype=torch.uint8).cuda()
    s = (torch.rand(256, 16, generator=gen) * 0.01 + 1e-3).cuda()
    m = (-torch.rand(256, 16, generator=gen) * 0.08).cuda()
    g = (torch.arange(512) // 32).cuda()
    ref = dequantize(q, s, None, g, m)
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    for cuda_int4 in ("triton", "tinygemm"):
        lin = QuantLinear(q, s, None, g, 4, 32, dtype=torch.bfloat16, mins=m, cuda_int4=cuda_int4)
        got, want = lin(x).float(), x.float() @ ref.T
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), (cuda_int4, (got - want).abs().max())


@pytest.mark.parametrize("reduce", ["partials", "atomic", "last"])
def test_cuda_int4_compiled_graph_step_matches_eager(tiny_checkpoint: Path, reduce: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The INT4 Triton ops inside the compiled, graphed decode step (custom ops with fake impls), with each
    place for the split-K sum (kernels.int4_triton.REDUCE): the in-kernel ones replayed by the graph step after
    step must leave their scratch zeroed, or the second step's sums would be off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(int4_triton, "REDUCE", reduce)
    torch._dynamo.reset()
    model = load_model(tiny_checkpoint, device="cuda")
    quantize_model(model, default_spec(4, 32))
    kernels = {m.kernel for m in model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"int4_triton"} if int4_triton.available() else {"int4pack"}, kernels
    n = model.config.n_layers
    eager = TorchRunner(model, SliceSpec(0, n, n), 256)
    compiled = TorchRunner(model, SliceSpec(0, n, n), 256, cuda_graphs=True, compile_decode=True)
    _decode_both(eager, compiled, 30, 8, 1e-3)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_cuda_quantised_checkpoint_matches_cpu(tiny_checkpoint: Path, tmp_path: Path, bits: int,
                                               group: int | None) -> None:
    quantize_checkpoint(tiny_checkpoint, tmp_path / "q", default_spec(bits, group))
    cpu = load_model(tmp_path / "q")
    gpu = load_model(tmp_path / "q", dtype=torch.bfloat16, device="cuda")
    n = cpu.config.n_layers
    a = TorchRunner(cpu, SliceSpec(0, n, n), 128)
    b = TorchRunner(gpu, SliceSpec(0, n, n), 128, cuda_graphs=True)
    ids = np.arange(1, 20, dtype=np.int32)[None]
    pos = np.arange(19, dtype=np.int32)[None]
    la, lb = a.run(ids, pos), b.run(ids, pos).cpu()
    assert (la - lb).abs().max() <= 0.05 * la.abs().max()


def test_cuda_int4_fused_projections_match_separate(tiny_checkpoint: Path) -> None:
    """partition.model.fuse_quantized_projections (what chain_loader does on CUDA): q/k/v and gate/up repacked
    into one int4_triton GEMV each give the separate layers' logits, eager and in the compiled graphed step."""
    from partition.model import fuse_quantized_projections

    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(tiny_checkpoint, device="cuda")
    quantize_model(model, default_spec(4, 32))
    if not int4_triton.available():
        pytest.skip("Triton is not installed: the INT4 layers are tinygemm's, which are not fused")
    n = model.config.n_layers
    ids, pos = np.arange(1, 12, dtype=np.int32)[None], np.arange(11, dtype=np.int32)[None]
    want = TorchRunner(model, SliceSpec(0, n, n), 64).run(ids, pos)
    assert fuse_quantized_projections(model) == n
    layer = model.model.layers[0]
    assert hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj")
    got = TorchRunner(model, SliceSpec(0, n, n), 64).run(ids, pos)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
    eager = TorchRunner(model, SliceSpec(0, n, n), 256)
    compiled = TorchRunner(model, SliceSpec(0, n, n), 256, cuda_graphs=True, compile_decode=True)
    _decode_both(eager, compiled, 30, 8, 1e-3)


def test_cuda_int4_prefill_auto_runs_the_fused_gemm_for_short_prompts(tiny_checkpoint: Path, monkeypatch) -> None:
    """PREFILL "auto" (the default): a prompt of up to MM_MAX_M tokens runs int4_mm (no layer dequantised), a longer
    one dequantises each layer once; both give the per-weight dequantise's logits to bf16's rounding."""
    from partition.model import fuse_quantized_projections

    if not int4_triton.available():
        pytest.skip("Triton is not installed: the INT4 layers are tinygemm's")
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16, device="cuda")
    quantize_model(model, default_spec(4, 32))
    fuse_quantized_projections(model)
    n = model.config.n_layers
    monkeypatch.setattr(int4_triton, "MM_MAX_M", 16)  # the tiny model's cache holds 64 slots
    calls = []
    real_many, real_mm = int4_triton.dequant_many, int4_triton.int4_mm
    monkeypatch.setattr(int4_triton, "dequant_many", lambda *a, **k: calls.append("dequant") or real_many(*a, **k))
    monkeypatch.setattr(int4_triton, "int4_mm", lambda *a, **k: calls.append("mm") or real_mm(*a, **k))
    for rows, want_calls in ((12, ["mm"] * 4 * n), (39, ["dequant"] * n)):
        ids, pos = np.arange(1, rows + 1, dtype=np.int32)[None] % 300, np.arange(rows, dtype=np.int32)[None]
        monkeypatch.setattr(int4_triton, "PREFILL", "dequant-each")
        want = TorchRunner(model, SliceSpec(0, n, n), 64).run(ids, pos).float()
        calls.clear()
        monkeypatch.setattr(int4_triton, "PREFILL", "auto")
        got = TorchRunner(model, SliceSpec(0, n, n), 64).run(ids, pos).float()
        assert calls == want_calls, (rows, calls)
        assert float((got - want).norm() / want.norm()) < 2e-2, rows


@pytest.mark.parametrize("mode", ["dequant", "dequant-ahead"])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_int4_prefill_layer_dequantise_matches_per_weight(tiny_checkpoint: Path, monkeypatch, fused: bool,
                                                               mode: str) -> None:
    """PREFILL "dequant" ("auto" does the same above MM_MAX_M rows): a prefill chunk dequantises each decoder
    layer's INT4 weights in one launch (kernels.weight_only.hold_prefill_weights), the same values as one launch a
    weight ("dequant-each"), so the same logits bit for bit; one launch a layer (two where the unfused layer has
    more than four weights), the held copies dropped after each layer, and decode steps never take it.
    "dequant-ahead" does the same launches a layer ahead on a side stream (kernels.weight_only.LayerPrefetch), with
    the same logits."""
    from kernels import weight_only
    from partition.model import fuse_quantized_projections

    if not int4_triton.available():
        pytest.skip("Triton is not installed: the INT4 layers are tinygemm's")
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16, device="cuda")
    quantize_model(model, default_spec(4, 32))
    if fused:
        fuse_quantized_projections(model)
    n = model.config.n_layers
    ids, pos = np.arange(1, 40, dtype=np.int32)[None] % 300, np.arange(39, dtype=np.int32)[None]
    monkeypatch.setattr(int4_triton, "PREFILL", "dequant-each")
    runner = TorchRunner(model, SliceSpec(0, n, n), 64)
    want = runner.run(ids, pos)
    want_step = runner.run(np.array([[7]], dtype=np.int32), np.array([[39]], dtype=np.int32))
    calls = []
    real = int4_triton.dequant_many

    def spy(*a, **k):
        calls.append((len(a[0]), torch.cuda.current_stream() == torch.cuda.default_stream()))
        return real(*a, **k)

    monkeypatch.setattr(int4_triton, "dequant_many", spy)
    monkeypatch.setattr(int4_triton, "PREFILL", mode)
    runner = TorchRunner(model, SliceSpec(0, n, n), 64)
    got = runner.run(ids, pos)
    assert torch.equal(got, want)
    in_line = mode == "dequant"  # else every launch on LayerPrefetch's side stream
    assert calls == [(w, in_line) for w in ([4] if fused else [4, 3])] * n, calls  # fused: qkv, o, gate/up, down
    held = [m for m in model.modules() if isinstance(m, weight_only.QuantLinear) and m.prefill_weight is not None]
    assert held == []
    calls.clear()
    step = runner.run(np.array([[7]], dtype=np.int32), np.array([[39]], dtype=np.int32))
    assert calls == [] and torch.equal(step, want_step)
    graphed = TorchRunner(model, SliceSpec(0, n, n), 64, cuda_graphs=True, prefill_graphs=True)  # captured 2nd time
    assert all(torch.equal(graphed.run(ids, pos), want) for _ in range(3)) and graphed.prefill_graphs.graphs


def test_cuda_int4_prefill_carveout_leaves_the_settings_as_they_were(tiny_checkpoint: Path, monkeypatch) -> None:
    """PREFILL "dequant-ahead" with PREFILL_CARVEOUT: the prefill's matmuls leave SMs to the side stream's
    dequantise while its layers run (kernels.int4_triton.carve_sms), and afterwards the carveout and the preferred
    BLAS are what they were, eager and graphed. The logits: the in-line dequantise's, to the matmuls' rounding
    (cuBLASLt on fewer SMs may pick another algorithm)."""
    if not int4_triton.available():
        pytest.skip("Triton is not installed: the INT4 layers are tinygemm's")
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16, device="cuda")
    quantize_model(model, default_spec(4, 32))
    n = model.config.n_layers
    ids, pos = np.arange(1, 40, dtype=np.int32)[None] % 300, np.arange(39, dtype=np.int32)[None]
    monkeypatch.setattr(int4_triton, "PREFILL", "dequant")
    want = TorchRunner(model, SliceSpec(0, n, n), 64).run(ids, pos)
    before = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
    seen = []
    real = int4_triton.dequant_many

    def spy(*a, **k):
        seen.append((torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()))
        return real(*a, **k)

    monkeypatch.setattr(int4_triton, "dequant_many", spy)
    monkeypatch.setattr(int4_triton, "PREFILL", "dequant-ahead")
    monkeypatch.setattr(int4_triton, "PREFILL_CARVEOUT", 16)
    for graphs in (False, True):
        runner = TorchRunner(model, SliceSpec(0, n, n), 64, cuda_graphs=graphs, prefill_graphs=graphs)
        for _ in range(3 if graphs else 1):  # graphed: eager, captured, replayed
            got = runner.run(ids, pos)
            assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), float((got - want).abs().max())
            assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == before
    assert seen and all(s == (16, torch._C._BlasBackend.Cublaslt) for s in seen), seen
