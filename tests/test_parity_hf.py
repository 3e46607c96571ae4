"""Parity with the reference implementation: random Llama / Qwen2 checkpoints written by Hugging Face
transformers, loaded by our loader, give the same fp32 logits for prefill and 16 cached decode steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from partition.checkpoint import load_model  # noqa: E402
from partition.slices import SliceSpec  # noqa: E402
from partition.runners.chain import Chain  # noqa: E402
from partition.runners.torch_runner import TorchRunner  # noqa: E402

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "llama3-rope-scaling": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2-bias-tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    torch.manual_seed(1234)
    ref = CASES[request.param]().eval()
    with torch.no_grad():  # HF's init zeroes biases; randomise them so the QKV-bias path is exercised
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_model(path)


def test_prefill_logits_match(pair) -> None:
    ref, ours = pair
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    positions = torch.arange(24, dtype=torch.int32).expand(2, -1)
    cfg = ours.config
    empty = [torch.zeros(2, cfg.n_kv_heads, 0, cfg.head_dim)] * (2 * cfg.n_layers)
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours.slice(0, cfg.n_layers, all_logits=True)(ids.int(), positions, *empty)[0]
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cuts", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["one-slice", "three-slices"])
def test_decode_with_kv_cache_matches(pair, cuts) -> None:
    ref, ours = pair
    n = ours.config.n_layers
    chain = Chain([TorchRunner(ours, SliceSpec(a, b, n), max_seq=64) for a, b in cuts])
    ids = torch.randint(0, SMALL["vocab_size"], (1, 10))
    with torch.no_grad():
        out = ref(ids, use_cache=True)
        past = out.past_key_values
        expected = out.logits[0, -1].numpy()
        got = chain.forward(ids.int().numpy(), np.arange(10, dtype=np.int32)[None])[0]
        assert np.abs(got - expected).max() <= 1e-4
        for step in range(16):
            token = int(np.argmax(expected))
            out = ref(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, expected = out.past_key_values, out.logits[0, -1].numpy()
            got = chain.forward(np.array([[token]], dtype=np.int32), np.array([[10 + step]], dtype=np.int32))[0]
            assert np.abs(got - expected).max() <= 1e-4, f"decode step {step}"
