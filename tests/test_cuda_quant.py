"""GPU paths of the decode work (run on the lent GPU machine; skipped without CUDA): in-place cache
attention against the export formulation, the compiled graphed step against eager, and QuantLinear's
CUDA kernels (tinygemm INT4, int8pack or the reference) against the plain dequantise-then-matmul."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.weight_only import QuantLinear, dequantize
from partition.checkpoint import load_model
from partition.quantize import QuantSpec, default_spec, quantize_checkpoint, quantize_weight
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


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, -1)])
def test_cuda_quant_linear_matches_reference(bits: int, group: int) -> None:
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    spec = QuantSpec(bits, group, sym=bits == 8)
    q, s, z = quantize_weight(w, spec)
    gs = 1024 if group == -1 else group
    g = torch.arange(1024) // gs
    dev = [t.cuda() for t in (q, s, z, g)]
    fast = QuantLinear(*dev, bits, gs, dtype=torch.bfloat16)
    assert fast.kernel == ("int4pack" if bits == 4 else "int8dq")
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize(dev[0], dev[1].float(), dev[2], dev[3]).T
    got = fast(x).float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max(), (got - expected).abs().max()


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
