"""Weight-only quantisation: the GPTQ / AWQ bit layouts, QuantLinear's kernels against the plain
dequantise-then-matmul reference, quantised checkpoints written and loaded back, export refused, and
the in-place KV-cache attention against the export formulation (all on CPU)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.weight_only import QuantLinear, dequantize
from partition.checkpoint import CheckpointError, load_model
from partition.quant_format import pack_awq, pack_gptq, unpack_awq, unpack_gptq
from partition.quantize import QuantSpec, default_spec, quantize_checkpoint, quantize_weight
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner


def test_gptq_words_follow_the_format() -> None:
    """Code k of column n sits at bits 4*(k % 8) of qweight[k // 8, n]; qzeros store zero - 1 (v1)."""
    q = torch.arange(8, dtype=torch.uint8).repeat(2, 1)  # (N=2, K=8): codes 0..7 in every row
    scales = torch.ones(2, 1, dtype=torch.float16)
    zeros = torch.tensor([[8], [3]], dtype=torch.int32)
    t = pack_gptq(torch.cat([q] * 4), torch.cat([scales] * 4), torch.cat([zeros] * 4), 4, -1)  # N = 8
    assert t["qweight"].shape == (1, 8) and int(t["qweight"][0, 0]) == 0x76543210
    assert t["qzeros"].shape == (1, 1) and int(t["qzeros"][0, 0]) == 0x27272727  # 7, 2, 7, 2 ... (zero - 1)
    assert t["scales"].shape == (1, 8) and t["g_idx"].tolist() == [0] * 8


@pytest.mark.parametrize("spec", [default_spec(8), default_spec(4), QuantSpec(4, 32, True), QuantSpec(8, 64, False)])
def test_gptq_roundtrip_and_rtn_error(spec: QuantSpec) -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    q, s, z = quantize_weight(w, spec)
    gs = 128 if spec.group_size == -1 else spec.group_size
    g = torch.arange(128) // gs
    # round to nearest: every weight within half a step of its dequantised value
    err = (dequantize(q, s.float(), z, g) - w).abs()
    assert bool((err <= s.float()[:, g] * 0.5 + 1e-6).all())
    q2, s2, z2, g2 = unpack_gptq(pack_gptq(q, s, z, spec.bits, spec.group_size), spec.bits)
    assert torch.equal(q2, q.int()) and torch.equal(s2, s) and torch.equal(z2, z) and torch.equal(g2, g.int())


def test_awq_layout_interleaves_and_roundtrips() -> None:
    q = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 32)  # (N=8, K=32): row n holds code n
    s, z = torch.ones(8, 1, dtype=torch.float16), torch.full((8, 1), 8, dtype=torch.int32)
    t = pack_awq(q, s, z)
    assert t["qweight"].shape == (32, 1) and int(t["qweight"][0, 0]) == 0x75316420  # order 0,2,4,6,1,3,5,7
    q2, s2, z2, _ = unpack_awq(t)
    assert torch.equal(q2, q.int()) and torch.equal(z2, z) and torch.equal(s2, s)


@pytest.mark.parametrize("bits,group,kernel", [(8, -1, "int8pack"), (4, 32, "int4pack_cpu"), (8, 32, "reference")])
def test_quant_linear_kernels_match_the_reference(bits: int, group: int, kernel: str) -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    spec = QuantSpec(bits, group, sym=bits == 8 and group == -1)
    q, s, z = quantize_weight(w, spec)
    g = torch.arange(128) // (128 if group == -1 else group)
    gs = 128 if group == -1 else group
    fast = QuantLinear(q, s, z, g, bits, gs)
    ref = QuantLinear(q, s, z, g, bits, gs, reference=True)
    assert fast.kernel == kernel and ref.kernel == "reference"
    x = torch.randn(5, 128)
    expected = x @ dequantize(q, s.float(), z, g).T
    assert torch.allclose(fast(x), expected, atol=1e-4) and torch.allclose(ref(x), expected, atol=1e-4)
    assert torch.allclose(fast.dequantized_weight(), dequantize(q, s.float(), z, g), atol=1e-6)


def _dequantised_float_model(qdir: Path, fp_dir: Path) -> torch.nn.Module:
    """The float model with each projection replaced by its reference dequantisation."""
    qmodel, model = load_model(qdir), load_model(fp_dir)
    for name, mod in qmodel.named_modules():
        if isinstance(mod, QuantLinear):
            model.get_submodule(name).weight.data = mod.dequantized_weight()
    return model


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantised_checkpoint_loads_and_matches_reference_dequant(tiny_checkpoint: Path, tmp_path: Path,
                                                                  bits: int, group: int | None) -> None:
    summary = quantize_checkpoint(tiny_checkpoint, tmp_path / "q", default_spec(bits, group))
    assert summary.layers_quantised == 4 * 7 and summary.quantised_bytes < summary.source_bytes
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    qmodel = load_model(tmp_path / "q")
    kinds = {m.kernel for m in qmodel.modules() if isinstance(m, QuantLinear)}
    assert kinds == {"int8pack" if bits == 8 else "int4pack_cpu"}
    ref = _dequantised_float_model(tmp_path / "q", tiny_checkpoint)
    n = qmodel.config.n_layers
    ids = np.arange(1, 30, dtype=np.int32)[None]
    pos = np.arange(29, dtype=np.int32)[None]
    a = TorchRunner(qmodel, SliceSpec(0, n, n), 64).run(ids, pos)
    b = TorchRunner(ref, SliceSpec(0, n, n), 64).run(ids, pos)
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()
    fp = TorchRunner(load_model(tiny_checkpoint), SliceSpec(0, n, n), 64).run(ids, pos)
    assert not torch.equal(a, fp)  # the weights really are the quantised ones


def test_quantised_checkpoint_refuses_onnx_export(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from partition.build import build_slices, ensure_build

    quantize_checkpoint(tiny_checkpoint, tmp_path / "q", default_spec(8))
    with pytest.raises(CheckpointError, match="cannot be exported to ONNX"):
        ensure_build(tmp_path / "q", cache_dir=tmp_path / "cache")
    with pytest.raises(CheckpointError, match="torch backend only"):
        build_slices(tmp_path / "q", None, tmp_path / "out")


def test_unsupported_quantization_config_is_a_clear_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    quantize_checkpoint(tiny_checkpoint, tmp_path / "q", default_spec(4, 32))
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not supported"):
        load_model(tmp_path / "q")


def test_in_place_cache_attention_matches_the_export_formulation(tiny_checkpoint: Path) -> None:
    """The runtime path (K/V written into the cache, SDPA over it) against concat + fp32 softmax,
    batch 2 with different histories, prefill then decode."""
    model = load_model(tiny_checkpoint)
    n = model.config.n_layers
    ref, fast = (TorchRunner(model, SliceSpec(0, n, n), 64, 2, kv_in_place=flag) for flag in (False, True))
    for r in (ref, fast):
        r.run(np.arange(1, 11, dtype=np.int32)[None], np.arange(10, dtype=np.int32)[None], [0])
        r.run(np.arange(3, 23, dtype=np.int32)[None], np.arange(20, dtype=np.int32)[None], [1])
    for step in range(6):
        tok = np.array([[step + 1], [step + 2]], dtype=np.int32)
        p = np.array([[10 + step], [20 + step]], dtype=np.int32)
        assert torch.allclose(ref.run(tok, p), fast.run(tok, p), atol=1e-4), step
    for a, b in zip(ref.cache, fast.cache):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_projections_compute_the_same_model_float_and_quantised(qkv_bias: bool) -> None:
    """fuse_projections stacks q/k/v and gate/up rows: the fused model's logits equal the unfused one's, in float
    and after the same group-wise quantisation (rows quantise alike), with and without q/k/v biases."""
    from partition.checkpoint import random_model
    from partition.config import ModelConfig
    from partition.model import fuse_projections
    from partition.quantize import quantize_model

    cfg = ModelConfig("LlamaForCausalLM", 512, 128, 2, 4, 2, 32, 256, max_position_embeddings=256,
                      tie_word_embeddings=True, qkv_bias=qkv_bias)
    ids = np.random.default_rng(3).integers(0, 512, (1, 7)).astype(np.int32)
    pos = np.arange(7, dtype=np.int32)[None]
    for quant in (False, True):
        plain, fused = random_model(cfg, seed=5).eval(), fuse_projections(random_model(cfg, seed=5).eval())
        assert not hasattr(fused.model.layers[0].self_attn, "q_proj")
        if quant:
            for m in (plain, fused):
                quantize_model(m, QuantSpec(4, 32, False), reference=True)
        want = TorchRunner(plain, SliceSpec(0, 2, 2), 16).run(ids, pos)
        got = TorchRunner(fused, SliceSpec(0, 2, 2), 16).run(ids, pos)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with pytest.raises(TypeError, match="before quantising"):
        fuse_projections(plain)


def test_decode_attention_formulations_agree() -> None:
    """The dense decode step's three probs @ V formulations (partition.model.DECODE_PV_CHOICES) compute the same
    attention, masked slots included, in fp32 and bf16."""
    from partition.model import DECODE_PV_CHOICES, MASK_VALUE, decode_attention_dense

    g = torch.Generator().manual_seed(0)
    b, kv, grp, length, hd = 2, 3, 4, 37, 16
    q, k, v = (torch.randn(b, kv, n, hd, generator=g) for n in (grp, length, length))
    mask = torch.zeros(b, 1, 1, length)
    mask[1, ..., 30:] = MASK_VALUE  # row 1 is shorter
    want = decode_attention_dense(q, k, v, mask, "matmul")
    assert want.abs().sum() > 0
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for pv in DECODE_PV_CHOICES:
            got = decode_attention_dense(q.to(dtype), k.to(dtype), v.to(dtype), mask, pv)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    short = decode_attention_dense(q[1:], k[1:, :, :30], v[1:, :, :30], mask[1:, ..., :30], "reduce")
    torch.testing.assert_close(decode_attention_dense(q, k, v, mask, "reduce")[1:], short, rtol=1e-5, atol=1e-5)
