"""INT8 group-wise KV-cache (kernels/kv_quant.py): the quantiser's error bound and layout, the cache's
quantise-on-write, the reference decode attention against FP attention, and the torch runner with
kv_cache="int8" against the FP runner on the shipped model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.kv_quant import (Int8KVCache, QuantizedPast, attention_reference, dequantize, fake_quantize,
                              fp_cache_bytes, int8_cache_bytes, quantize)
from partition.model import dense_past


@pytest.mark.parametrize("group", [32, 64])
def test_round_trip_error_is_within_half_a_step_per_group(group: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 64) * torch.logspace(-3, 2, 64)  # channels of very different magnitudes
    q, scale = quantize(x, group)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert scale.shape == (2, 3, 5, 64 // group)
    err = (dequantize(q, scale, torch.float32) - x).abs().unflatten(-1, (64 // group, group))
    step = scale.float()[..., None]
    assert bool((err <= step * 0.5 + 1e-6).all())
    assert int(q.abs().max()) == 127  # the absmax of each group maps to the end of the range


def test_zero_group_and_wrong_group() -> None:
    q, scale = quantize(torch.zeros(1, 64), 32)
    assert bool((q == 0).all()) and bool((scale == 0).all())
    with pytest.raises(ValueError, match="one of"):
        quantize(torch.zeros(1, 64), 16)
    with pytest.raises(ValueError, match="multiple"):
        quantize(torch.zeros(1, 96), 64)


@pytest.mark.parametrize("tile", [1, 4])
def test_cache_quantises_on_write_and_views_like_a_tensor(tile: int) -> None:
    """Token-tiled storage (the V layout of the Triton decode kernel) reads and writes like the plain one."""
    torch.manual_seed(1)
    cache = Int8KVCache((3, 2, 8, 64), 32, token_tile=tile)
    dense = torch.zeros(3, 2, 8, 64)
    fresh = torch.randn(2, 3, 64)
    cache[1, :, 4:7] = fresh
    dense[1, :, 4:7] = fake_quantize(fresh, 32)
    past = cache[0:2, :, :7]
    assert isinstance(past, QuantizedPast) and past.shape == (2, 2, 7, 64)
    assert torch.equal(dense_past(past, torch.float32), dense[0:2, :, :7])
    picked = cache[:, :, :7].index_select(0, torch.tensor([2, 1]))
    assert torch.equal(picked.dequantize(torch.float32), dense[[2, 1], :, :7])
    assert cache.nbytes == int8_cache_bytes((3, 2, 8, 64), 32)
    assert cache.shape == (3, 2, 8, 64) and cache.q.shape == ((3, 2, 8, 64) if tile == 1 else (3, 2, 2, 64, 4))
    if tile > 1:  # slot s, channel d of a (row, head) plane at tile s // 4, byte d * 4 + s % 4
        assert torch.equal(cache.q[1, :, 1, :, 0:3], cache.values()[1, :, 4:7].transpose(-1, -2))
        with pytest.raises(ValueError, match="divide"):
            Int8KVCache((1, 1, 10, 64), 32, token_tile=4)


def test_bytes_against_fp16() -> None:
    shape = (1, 2, 1024, 64)
    fp16 = fp_cache_bytes(shape)
    assert int8_cache_bytes(shape, 32) / fp16 == pytest.approx(68 / 128)  # -46.9 % with the scales
    assert int8_cache_bytes(shape, 64) / fp16 == pytest.approx(66 / 128)


@pytest.mark.parametrize("group", [32, 64])
def test_reference_attention_close_to_fp_attention(group: int) -> None:
    torch.manual_seed(2)
    b, h, kv, s, hd = 2, 6, 2, 40, 64
    q = torch.randn(b, h, hd)
    k, v = torch.randn(b, kv, s, hd), torch.randn(b, kv, s, hd)
    lengths = torch.tensor([40, 17])
    out = attention_reference(q, *quantize(k, group), *quantize(v, group), lengths)
    # FP reference: plain softmax attention over the first lengths[b] slots, GQA by repeat.
    for r in range(b):
        n = int(lengths[r])
        kk = k[r, :, :n].repeat_interleave(h // kv, 0)
        vv = v[r, :, :n].repeat_interleave(h // kv, 0)
        want = torch.einsum("hs,hsd->hd", torch.softmax(torch.einsum("hd,hsd->hs", q[r], kk) / math.sqrt(hd), -1), vv)
        assert torch.allclose(out[r], want, atol=0.05), float((out[r] - want).abs().max())
    # masked slots are really ignored: garbage past lengths[1] changes nothing
    k2 = k.clone()
    k2[1, :, 17:] = 1e3
    out2 = attention_reference(q, *quantize(k2, group), *quantize(v, group), lengths)
    assert torch.equal(out[1], out2[1])


@pytest.fixture(scope="module")
def shipped_model():  # noqa: ANN201 - a Transformer; loading is the slow part, shared by the tests
    from partition.checkpoint import load_model
    from partition.paths import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("the shipped model is not present")
    return load_model(DEFAULT_MODEL_DIR)


def _greedy(runner, prompt: list[int], n: int, row: int = 0) -> tuple[list[int], list[np.ndarray]]:  # noqa: ANN001
    pos = np.arange(len(prompt), dtype=np.int32)[None]
    logits = runner.run(np.asarray([prompt], dtype=np.int32), pos, [row])
    out, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits[0].numpy())
        nxt = int(logits[0].argmax())
        out.append(nxt)
        pos = pos[:, -1:] + 1
        logits = runner.run(np.asarray([[nxt]], dtype=np.int32), pos, [row])
    return out, all_logits


def test_int8_runner_matches_fp_runner_greedy(shipped_model) -> None:  # noqa: ANN001
    from partition.slices import SliceSpec
    from partition.runners.torch_runner import TorchRunner

    n = shipped_model.config.n_layers
    prompt = list(range(5, 45))
    fp = TorchRunner(shipped_model, SliceSpec(0, n, n), 128, 2)
    q8 = TorchRunner(shipped_model, SliceSpec(0, n, n), 128, 2, kv_cache="int8")
    assert isinstance(q8.cache[0], Int8KVCache)
    a, la = _greedy(fp, prompt, 24)
    b, lb = _greedy(q8, prompt, 24, row=1)  # another row: views of rows other than 0 too
    assert a == b
    assert max(float(np.abs(x - y).max()) for x, y in zip(la, lb)) < 0.5  # logits close, not equal
    assert any(not np.array_equal(x, y) for x, y in zip(la, lb))  # the int8 path was really taken


def test_int8_option_errors() -> None:
    from partition.runners import BackendUnavailable, load_chain
    from partition.paths import DEFAULT_MODEL_DIR

    with pytest.raises(BackendUnavailable, match="not built yet"):
        load_chain(DEFAULT_MODEL_DIR, backend="trt", kv_cache="int8", device="cuda")
    with pytest.raises(ValueError, match="not one of"):
        load_chain(DEFAULT_MODEL_DIR, kv_cache="fp8")


def test_config_key() -> None:
    from agent.config import ConfigError, config_from_mapping

    assert config_from_mapping({"model": {"kv_cache": "int8"}}, "t.toml").kv_cache == "int8"
    with pytest.raises(ConfigError, match="model.kv_cache"):
        config_from_mapping({"model": {"kv_cache": "int4"}}, "t.toml")
    with pytest.raises(ConfigError, match="backend"):
        config_from_mapping({"model": {"kv_cache": "int8", "backend": "trt"}}, "t.toml")
    assert config_from_mapping({"model": {"kv_cache": "int8", "backend": "ort"}}, "t.toml").backend == "ort"
