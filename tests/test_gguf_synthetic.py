"""GGUF files written here with llama.cpp's own writer (gguf.GGUFWriter), for what the one real model does not
cover: a SentencePiece-style `llama` vocabulary, the qwen2 architecture (QKV bias, no rope permutation), block
types Q4_0 / Q4_K / Q8_0 / Q5_0 and F16 / BF16 tensors, an untied output head, refused architectures. The files
go through partition/gguf and through transformers' own GGUF loader, which must agree; every block unpacking
is held against the gguf package's dequantisation."""
from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from partition.config import ModelConfig
from smollm2_helpers import full_logits

LLAMA_TYPES = {"attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0, "attn_output": QT.Q4_K,
               "ffn_gate": QT.Q5_0, "ffn_up": QT.F16, "ffn_down": QT.BF16}
WORDS = "the quick brown fox jumps over the lazy dog and then the cat sat on a mat of red wool".split()


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then every prefix of '▁word' as a piece (scored so that
    longer pieces merge later, as SentencePiece BPE scores its merges)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces: list[str] = []
    for w in WORDS:
        for piece in ["\u2581" + w[:i] for i in range(0, len(w) + 1)] + list(w) + [w[i:] for i in range(1, len(w))]:
            if piece and piece not in pieces:
                pieces.append(piece)
    pieces.sort(key=len)
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _block(kind: QT, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if kind == QT.F16:
        return w.astype(np.float16)
    if kind == QT.Q4_K:  # no quantiser in gguf-py: any bytes are a valid block; small scales, random codes
        n, k = w.shape
        raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.array([0.002, 0.001], np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    return gguf.quants.quantize(w, kind)


def write_gguf(path: Path, arch: str, cfg: ModelConfig, tied: bool, seed: int = 0,
               types: dict[str, QT] | None = None) -> None:
    rng = np.random.default_rng(seed)
    tokens, scores, ttypes = sentencepiece_vocab()
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    d, kv = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim
    gauss = (lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32))
    w.add_tensor("token_embd.weight", gguf.quants.quantize(gauss(cfg.vocab_size, d), QT.Q8_0), raw_dtype=QT.Q8_0)
    w.add_tensor("output_norm.weight", (1 + gauss(d)).astype(np.float32))
    if not tied:
        w.add_tensor("output.weight", gauss(cfg.vocab_size, d))
    shapes = {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
              "ffn_gate": (cfg.intermediate_size, d), "ffn_up": (cfg.intermediate_size, d),
              "ffn_down": (d, cfg.intermediate_size)}
    for i in range(cfg.n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + gauss(d)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + gauss(d)).astype(np.float32))
        for name, shape in shapes.items():
            x = gauss(*shape)
            if arch == "llama" and name in ("attn_q", "attn_k"):
                x = permute(x, cfg.n_heads if name == "attn_q" else cfg.n_kv_heads)
            kind = (types or LLAMA_TYPES)[name]
            w.add_tensor(f"blk.{i}.{name}.weight", _block(kind, x, rng), raw_dtype=kind if kind != QT.F16 else None)
            if cfg.qkv_bias and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", gauss(shape[0]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _config(arch: str, tied: bool) -> ModelConfig:
    vocab = len(sentencepiece_vocab()[0])
    return ModelConfig("LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM", vocab, 256, 2, 4, 2, 64, 512,
                       rope_theta=10000.0, max_position_embeddings=128, qkv_bias=arch == "qwen2",
                       tie_word_embeddings=tied, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    arch, tied = request.param
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf"
    write_gguf(path, arch, _config(arch, tied), tied)
    return path, _config(arch, tied)


def test_gguf_synthetic_config_and_weights_match_transformers(written, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    from partition.gguf.reader import read_model
    from partition.gguf.tensors import load_gguf_model

    path, cfg = written
    got = read_model(path).config
    assert got == cfg
    ours = load_gguf_model(path, dequantize=True).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for name, w in theirs.state_dict().items():
        assert torch.equal(ours[name], w), name
    ids = [1, 5, 300, 301, 17, 260, 42, 299]
    with caplog.at_level(logging.WARNING, logger="orin_agent.gguf"):
        quant = load_gguf_model(path)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "2 Q5_0 tensors dequantised" in notes[0]  # one line, naming the type
    with torch.no_grad():
        hf = theirs(torch.tensor([ids])).logits[0]
    assert (full_logits(load_gguf_model(path, dequantize=True), ids) - hf).abs().max().item() < 1e-4
    assert (full_logits(quant, ids) - hf).abs().max().item() < 1e-3


def test_gguf_synthetic_blocks_load_as_their_layout(written) -> None:
    from partition.gguf.tensors import layout, load_gguf_model

    path, cfg = written
    kinds = layout(load_gguf_model(path))
    assert kinds["model.layers.0.self_attn.q_proj"] == "int4pack_cpu"  # Q4_0: integer zero 8
    assert kinds["model.layers.0.self_attn.k_proj"] == "int4pack_cpu"  # Q4_1: float mins
    assert kinds["model.layers.1.self_attn.o_proj"] == "int4pack_cpu"  # Q4_K: float mins
    assert kinds["model.layers.0.self_attn.v_proj"] == "reference"  # Q8_0: group-wise INT8
    assert "model.layers.0.mlp.gate_proj" not in kinds  # Q5_0: dequantised
    assert kinds["model.embed_tokens"] == "gather"
    assert ("lm_head" in kinds) == cfg.tie_word_embeddings  # tied: the Q8_0 embedding is also the head


def test_gguf_sentencepiece_tokenizer_equals_transformers(written) -> None:
    from transformers import AutoTokenizer

    from partition.gguf.folder import resolve_model
    from partition.tokenizer import Tokenizer

    path, _ = written
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_dir(resolve_model(path, path.parent / "models"))
    assert ours.add_bos and ours.bos_id == 1 and ours.eos_ids == frozenset({2})
    for s in ["the quick brown fox", " the  lazy dog", "then the cat sat", "qzx 123 ünïcødé 🎉", "a\tb\nc",
              "the</s> dog", "over the mat of red wool"]:
        assert ours.encode(s) == theirs.encode(s), repr(s)
        assert ours.decode(ours.encode(s)) == theirs.decode(theirs.encode(s), skip_special_tokens=True), repr(s)
    # a text (a rendered chat template) that starts with BOS gets no second one (transformers adds it twice)
    assert ours.encode("<s>the") == theirs.encode("<s>the", add_special_tokens=False) == [1, 260, 287]


def test_gguf_unpermute_rows_inverts_llama_cpp_permute() -> None:
    from partition.gguf.tensors import unpermute_rows

    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        assert np.array_equal(permute(w, heads)[unpermute_rows(12, heads)], w)
    assert not np.array_equal(permute(w, 2), w)


def test_gguf_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    from partition.gguf.reader import GGUFError, read_model

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="'gemma2' is not supported; supported: llama, qwen2"):
        read_model(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        read_model(tmp_path / "junk.gguf")


def test_gguf_model_argument_errors_are_one_line(tmp_path: Path) -> None:
    from partition.gguf.folder import GGUFError, resolve_model

    with pytest.raises(GGUFError, match="no such file"):
        resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="smollm2-135m-instruct"):
        resolve_model(tmp_path / "nothing-here")
