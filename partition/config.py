"""Model configuration: one frozen dataclass for the Llama family, read from a Hugging Face config.json,
and named presets with the shapes of real models (random weights, for speed and memory work).

Supported: Llama 2/3/3.x (with the Llama-3 RoPE frequency scaling), Qwen2/2.5 (QKV bias), Mistral
(no sliding window). Everything else is refused with a message that lists what is supported.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# The KV-cache length when none is asked for is the model's context capped here (presets declare up to
# 131072 positions): partition.runners.base.default_max_seq, the one rule of every runner, the TensorRT
# engines' profiles and `--max-seq`'s help. Torch-free, so the CLI's help can state it.
MAX_SEQ_CAP = 8192
# `--dtype` names of the float parts (partition.checkpoint.DTYPES maps them to torch dtypes).
DTYPE_NAMES = ("fp32", "fp16", "bf16")
DEFAULT_DTYPE = "fp32"
# The torch runner on CUDA (no exit heads: they run fp32) defaults to fp16, as llama.cpp's CUDA path computes:
# SmolLM2-135M Q4_1 on an H200, interleaved in one run (scripts/bench_peer.py --device cuda, 2026-12-02),
# 580.4 tok/s in fp16 against 511.8 in fp32 (the same kernels; a KV-cache and activations of half the bytes).
CUDA_DEFAULT_DTYPE = "fp16"


def default_dtype(backend: str, device: str, exits: bool = False) -> str:
    """The float parts' dtype when none is asked for: CUDA_DEFAULT_DTYPE for the torch runner on a CUDA device
    without exit heads, else DEFAULT_DTYPE (the ONNX graphs are fp32; on the CPU fp16 is no faster)."""
    return CUDA_DEFAULT_DTYPE if backend == "torch" and device.startswith("cuda") and not exits else DEFAULT_DTYPE


class ModelConfigError(ValueError):
    """A config.json or preset that this runtime cannot serve; the message says why and what to do."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (`rope_scaling.rope_type == "llama3"` in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.n_heads}) must be a multiple of num_key_value_heads "
                f"({self.n_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, kv = self.hidden_size, self.n_kv_heads * self.head_dim
        attn = d * self.n_heads * self.head_dim * 2 + d * kv * 2
        if self.qkv_bias:
            attn += self.n_heads * self.head_dim + 2 * kv
        per_layer = attn + 3 * d * self.intermediate_size + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.n_layers * per_layer + emb + d

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """A config.json that Hugging Face transformers (and this loader) read back unchanged;
        `torch_dtype` records the dtype of the weights on disk."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": torch_dtype,
        }
        if self.architecture == "LlamaForCausalLM":
            out["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ModelConfigError(f"{source}: missing key {key!r}")
    return cfg[key]


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate a Hugging Face config dict into a ModelConfig; errors name the file and the key."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in _MODEL_TYPES.items()}.get(cfg.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: architecture {arch or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu', SwiGLU)")
    hidden = int(_require(cfg, "hidden_size", source))
    n_heads = int(_require(cfg, "num_attention_heads", source))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" and window is not None and int(window) < max_pos:
        # Sliding-window attention is not implemented: cap the context at the window instead,
        # which is exact (no token ever looks further back than the window).
        max_pos = int(window)
    scaling = None
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files `rope_scaling`.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rs = cfg.get("rope_scaling") or rope_params
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                  float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
        elif kind != "default":
            raise ModelConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    bias = bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        n_layers=int(_require(cfg, "num_hidden_layers", source)),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=max_pos,
        qkv_bias=bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """config.json of a model folder. A .gguf file or a model alias is made a folder first
    (partition.gguf.folder.resolve_model, which the front ends, the tokenizer and the loaders call): the
    GGUF reader builds on this module, so this module never calls it."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: not found; a model folder needs config.json, *.safetensors "
                               "and tokenizer.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    return config_from_hf(raw, str(path))


# Shapes from each model's published config.json on the Hugging Face hub (meta-llama/Meta-Llama-3-8B,
# meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-3B, Qwen/Qwen2.5-0.5B/1.5B/7B, mistralai/Mistral-7B-v0.3).
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig("LlamaForCausalLM", 128256, 4096, 32, 32, 8, 128, 14336, rope_theta=500000.0,
                              max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.2-1b": ModelConfig("LlamaForCausalLM", 128256, 2048, 16, 32, 8, 64, 8192, rope_theta=500000.0,
                                rope_scaling=_LLAMA32_ROPE, max_position_embeddings=131072,
                                tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.2-3b": ModelConfig("LlamaForCausalLM", 128256, 3072, 28, 24, 8, 128, 8192, rope_theta=500000.0,
                                rope_scaling=_LLAMA32_ROPE, max_position_embeddings=131072,
                                tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,)),
    "qwen2.5-0.5b": ModelConfig("Qwen2ForCausalLM", 151936, 896, 24, 14, 2, 64, 4864, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, max_position_embeddings=32768, qkv_bias=True,
                                tie_word_embeddings=True, eos_token_ids=(151643,)),
    "qwen2.5-1.5b": ModelConfig("Qwen2ForCausalLM", 151936, 1536, 28, 12, 2, 128, 8960, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, max_position_embeddings=32768, qkv_bias=True,
                                tie_word_embeddings=True, eos_token_ids=(151643,)),
    "qwen2.5-7b": ModelConfig("Qwen2ForCausalLM", 152064, 3584, 28, 28, 4, 128, 18944, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, max_position_embeddings=131072, qkv_bias=True,
                              eos_token_ids=(151643,)),
    "mistral-7b": ModelConfig("MistralForCausalLM", 32768, 4096, 32, 32, 8, 128, 14336, rope_theta=1000000.0,
                              max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,)),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None
