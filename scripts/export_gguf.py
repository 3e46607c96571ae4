#!/usr/bin/env python3
"""A Llama checkpoint folder (the shipped `models/stdlib-llama-8l` by default) written as a GGUF file with
llama.cpp's own writer (`gguf.GGUFWriter`), so llama.cpp and the project can run the same model file
side by side (scripts/bench_peer.py).

What is written, following llama.cpp's convert_hf_to_gguf.py (LlamaModel) conventions:
  - the 2-D layer weights in `--type` (q4_0 | q4_1 | q8_0 | f16), quantised with `gguf.quants.quantize`
    (gguf-py's reference quantisers, the same rounding as ggml's quantize_row_*_ref);
  - the token embedding (tied: also the output head, llama.cpp reads token_embd when output.weight is
    absent) in Q8_0, or F16 for `--type f16` (the converter's default keeps it at the layer type for
    f16/q8_0; llama-quantize keeps Q8_0-or-better for token_embd/output at the low-bit types);
  - RMSNorm weights in F32 (1-D tensors stay F32 in every llama.cpp file type);
  - the rows of q_proj and k_proj permuted from Hugging Face's rotate-half order to llama.cpp's
    interleaved pairs (LlamaModel.permute); the exact inverse of partition/gguf/tensors.py's
    `unpermute_rows`, so the project's reader gives back the checkpoint's rows;
  - metadata under llama.cpp's keys: `llama.*` hyperparameters, a byte-level BPE vocabulary as
    tokenizer.ggml.model "gpt2" with pre-tokenizer "gpt-2" (the GPT-2 split regex that a `tokenizers`
    ByteLevel(use_regex=True) pre-tokenizer applies; llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2), the token
    list, token types (added special tokens as CONTROL), merges, eos/pad (and bos = eos, GPT-2's
    convention, with add_bos_token false) and the chat template.

    python3 scripts/export_gguf.py --out /tmp/shipped-q4_0.gguf [--type q4_0] [--model models/stdlib-llama-8l]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TYPES = ("q4_0", "q4_1", "q8_0", "f16")
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


class ExportError(ValueError):
    pass


def permute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order llama.cpp's converter writes q/k in: gguf = hf[rows] (the inverse of unpermute_rows)."""
    from partition.gguf.tensors import unpermute_rows

    return np.argsort(unpermute_rows(n_rows, n_heads))


def gguf_name(hf: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        module = ".".join(parts[3:-1])
        if module in _HF_TO_GGUF:
            return f"blk.{parts[2]}.{_HF_TO_GGUF[module]}.{parts[-1]}"
    return None


def _tokenizer(model_dir: Path) -> dict[str, Any]:
    """tokenizer.json (a byte-level BPE) as llama.cpp's tokenizer.ggml.* values."""
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
            or pre.get("add_prefix_space") or data.get("normalizer") is not None:
        raise ExportError(f"{model_dir}/tokenizer.json: only a byte-level BPE with ByteLevel(use_regex=True, "
                          "add_prefix_space=False) and no normalizer is exported (llama.cpp pre-tokenizer 'gpt-2')")
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)  # gguf.TokenType.NORMAL
    for added in data.get("added_tokens", []):
        i = int(added["id"])
        if i >= len(tokens):
            raise ExportError(f"{model_dir}/tokenizer.json: added token {added['content']!r} lies outside the vocabulary")
        tokens[i] = added["content"]
        types[i] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges}


def export(model_dir: Path, out: Path, kind: str) -> dict[str, int]:
    """Write `model_dir` to `out` as GGUF; returns the count of tensors per GGML type."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as QT

    from partition.checkpoint import load_model
    from partition.config import load_config

    cfg = load_config(model_dir)
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias or cfg.rope_scaling is not None:
        raise ExportError(f"{model_dir}: only a plain Llama architecture (no QKV bias, no rope scaling) is exported; "
                          f"this one is {cfg.architecture}")
    side = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8")) \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    tok = _tokenizer(model_dir)
    if len(tok["tokens"]) != cfg.vocab_size:
        raise ExportError(f"{model_dir}: tokenizer has {len(tok['tokens'])} tokens, config.json's vocab_size is "
                          f"{cfg.vocab_size}")
    layer_type = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0, "f16": QT.F16}[kind]
    embed_type = QT.F16 if kind == "f16" else QT.Q8_0
    file_type = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16}[kind]
    model = load_model(model_dir, dtype=torch.float32)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(model_dir.name)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    if eos is not None:
        w.add_eos_token_id(eos)
        w.add_bos_token_id(cfg.bos_token_id if cfg.bos_token_id is not None else eos)
    pad = side.get("pad_token")
    if isinstance(pad, str) and pad in tok["tokens"]:
        w.add_pad_token_id(tok["tokens"].index(pad))
    w.add_add_bos_token(bool(side.get("add_bos_token", False)))
    if isinstance(side.get("chat_template"), str):
        w.add_chat_template(side["chat_template"])

    counts: dict[str, int] = {}
    q_rows = permute_rows(cfg.n_heads * cfg.head_dim, cfg.n_heads)
    k_rows = permute_rows(cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads)
    for hf, arr in state.items():
        name = gguf_name(hf)
        if name is None:
            raise ExportError(f"{model_dir}: tensor {hf} has no GGUF name")
        if ".self_attn.q_proj." in hf:
            arr = arr[q_rows]
        elif ".self_attn.k_proj." in hf:
            arr = arr[k_rows]
        if arr.ndim == 1:
            t = QT.F32
        elif name == "token_embd.weight" or name == "output.weight":
            t = embed_type
        else:
            t = layer_type
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if t == QT.F32:
            w.add_tensor(name, arr)
        elif t == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)
        counts[t.name] = counts.get(t.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "stdlib-llama-8l",
                    help="checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    ap.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    ap.add_argument("--type", choices=TYPES, default="q4_0", help="the 2-D layer weights' GGML type")
    a = ap.parse_args(argv)
    if a.out.suffix.lower() != ".gguf":
        sys.exit(f"--out {a.out}: give a file name ending in .gguf")
    if a.out.is_dir():
        sys.exit(f"--out {a.out}: is a folder; give a file name ending in .gguf")
    if not (a.model / "config.json").is_file():
        sys.exit(f"--model {a.model}: no config.json there; pass a checkpoint folder")
    from partition.checkpoint import CheckpointError
    from partition.config import ModelConfigError

    try:
        counts = export(a.model, a.out, a.type)
    except (ExportError, CheckpointError, ModelConfigError) as exc:
        sys.exit(str(exc))
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.1f} MB; tensors: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ")")


if __name__ == "__main__":
    main()
