"""Reading a GGUF file's header: opening it (partition.gguf.header: memory-mapped, so tensors are read
only when used, as views of llama.cpp's own `gguf` package's types), its metadata as plain Python values,
and the model configuration it describes as the project's `ModelConfig`.

Architectures: `llama` (Llama 1/2/3.x and Mistral, which llama.cpp writes as `llama`) and `qwen2`
(QKV bias): the Llama family the one model definition covers. Anything else is refused naming it.
Keys are llama.cpp's (`{arch}.block_count`, `{arch}.attention.head_count`, ...: gguf-py's
`gguf/constants.py` `Keys`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from partition.config import ModelConfig, ModelConfigError, RopeScaling
from partition.gguf.errors import GGUFError
from partition.gguf.header import GGUFFile

# GGUF architecture -> (the project's architecture, whether llama.cpp's converter permuted Q/K for its
# rope: convert_hf_to_gguf.py's LlamaModel.modify_tensors permutes q_proj/k_proj; Qwen2Model does not)
ARCHITECTURES: dict[str, tuple[str, bool]] = {"llama": ("LlamaForCausalLM", True),
                                              "qwen2": ("Qwen2ForCausalLM", False)}


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file; pass a .gguf model file, a checkpoint folder, or a model alias")
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as exc:  # wrong magic, truncated header (header.GGUFHeaderError is a ValueError)
        raise GGUFError(f"{path}: not a readable GGUF file ({exc}); download it again") from None


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key as a Python value (arrays as lists); a FLOAT32 scalar as the shortest decimal of the stored
    float32 (1e-05, not 9.99999974e-06)."""
    return {k: float(str(np.float32(v))) if reader.types[k] == (GGUFValueType.FLOAT32,) else v
            for k, v in reader.fields.items()}


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, read once: its path, metadata, the config it describes, and whether its Q/K
    rows are in llama.cpp's rope order."""

    path: Path
    reader: GGUFFile
    meta: dict[str, Any]
    config: ModelConfig
    permuted_qk: bool

    @property
    def name(self) -> str:
        return str(self.meta.get("general.name") or self.path.stem)


def _rope_scaling(reader: GGUFFile, meta: dict[str, Any], arch: str, head_dim: int, theta: float,
                  source: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise GGUFError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported (only Llama-3 frequency "
                        "scaling, which llama.cpp stores as the rope_freqs tensor)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1+ files carry the per-frequency divisors (convert_hf_to_gguf.py's rope_freqs for rope_type
    # llama3), not the parameters. Meta's published Llama 3.1 / 3.2 parameters (low 1, high 4, original
    # context 8192; factor 8 or 32) are tried, and kept only if they rebuild the stored divisors.
    from partition.model import rope_inv_freq

    stored = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
    base = ModelConfig("LlamaForCausalLM", 8, head_dim, 1, 1, 1, head_dim, 8, rope_theta=theta)
    for factor in sorted({float(stored.max()), 8.0, 32.0}):
        cand = RopeScaling(factor, 1.0, 4.0, 8192)
        cfg = ModelConfig(**{**base.to_dict(), "rope_scaling": cand})
        ratio = (rope_inv_freq(base) / rope_inv_freq(cfg)).numpy()
        if ratio.shape == stored.shape and np.allclose(ratio, stored, rtol=1e-4):
            return cand
    raise GGUFError(f"{source}: the rope_freqs tensor is not Llama-3 frequency scaling with Meta's parameters; "
                    "this file's rope cannot be reproduced")


def read_model(path: str | Path) -> GGUFModel:
    """Open a GGUF file and read its config; unsupported architectures and keys are refused by name."""
    path = Path(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    source = str(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)} (Mistral files are written as 'llama')")
    project_arch, permuted = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFError(f"{source}: metadata key {full!r} is missing; the file is incomplete")
        return meta[full]

    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // n_heads)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    names = {t.name for t in reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else None
    if vocab is None:
        raise GGUFError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    try:
        config = ModelConfig(
            architecture=project_arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or n_heads),
            head_dim=head_dim,
            intermediate_size=int(need("feed_forward_length")),
            rope_theta=theta,
            rope_scaling=_rope_scaling(reader, meta, arch, head_dim, theta, source),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            qkv_bias="blk.0.attn_q.bias" in names,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        )
    except ModelConfigError as exc:
        raise GGUFError(f"{source}: {exc}") from None
    return GGUFModel(path, reader, meta, config, permuted)
