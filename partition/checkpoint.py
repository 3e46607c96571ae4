"""Checkpoint folders: load a Hugging Face folder (config.json, one or many *.safetensors, tokenizer.json)
into the one model definition, build random-weight models from presets, and save folders back.
A folder whose config.json has `quantization_config` (GPTQ / AWQ) is loaded by partition/quantize.py;
a GGUF file (or its alias, or the model folder made for it, partition/gguf/folder.py) by partition/gguf.

Loading builds the model on the `meta` device (no memory), reads each tensor once from the
memory-mapped safetensors file and hands it to the module with `assign=True`, so the weights are
never held twice (gpt-fast does the same).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from partition.config import ModelConfig, ModelConfigError, load_config
from partition.model import Transformer, rope_inv_freq

LOADABLE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and what to do."""


def _shards(model_dir: Path) -> list[Path]:
    from partition.gguf.folder import gguf_source

    source = gguf_source(model_dir)
    if source is not None:  # a GGUF file's model folder: the file holds every weight
        return [source]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} is missing; "
                                      "download the complete checkpoint")
        return shards
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        hint = " (pytorch_model.bin is not loaded: convert it to safetensors)" if any(
            model_dir.glob("*.bin")) else ""
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found{hint}")
    return shards


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", dequantize: bool = False) -> Transformer:
    """Load a checkpoint folder, a .gguf file or a model alias as a Transformer in `dtype` on `device`, in
    eval mode. A GGUF's quantised blocks stay codes (QuantLinear) unless `dequantize` (floats in `dtype`,
    e.g. for ONNX export or re-quantisation)."""
    from partition.gguf.folder import gguf_source, is_gguf_ref, resolve_model

    model_dir = resolve_model(model_dir) if is_gguf_ref(model_dir) else Path(model_dir)
    source = gguf_source(model_dir) if model_dir.is_dir() else None
    if source is not None:
        from partition.gguf.tensors import load_gguf_model

        return load_gguf_model(source, dtype, device, dequantize=dequantize)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a folder; pass a checkpoint folder with config.json, "
                              "*.safetensors and tokenizer.json")
    config = load_config(model_dir)
    from partition.quantize import load_quantized, quantization_config

    qcfg = quantization_config(model_dir)
    if qcfg is not None:  # GPTQ / AWQ weights: projections become kernels.weight_only.QuantLinear
        return load_quantized(model_dir, qcfg, dtype, device)
    with torch.device("meta"):
        model = Transformer(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # tied checkpoints store the embedding once
    state: dict[str, torch.Tensor] = {}
    for shard in _shards(model_dir):
        try:
            with safe_open(str(shard), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key not in expected:
                        continue  # e.g. rotary inv_freq buffers or a duplicate tied lm_head
                    kind = f.get_slice(key).get_dtype()
                    if kind not in LOADABLE_DTYPES:
                        raise CheckpointError(
                            f"{shard}: tensor {key} has dtype {kind}; loadable dtypes are "
                            f"{', '.join(LOADABLE_DTYPES)} (quantised checkpoints such as GPTQ/AWQ are not "
                            "supported: use the unquantised weights)")
                    state[key] = f.get_tensor(key).to(dtype)
        except SafetensorError as exc:
            raise CheckpointError(f"{shard}: unreadable safetensors file, probably truncated or corrupt "
                                  f"({exc}); download it again") from None
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{model_dir}: weights do not match config.json ({exc})") from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config).to(device)
    return model.eval()


def random_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Transformer:
    """A model with the preset's real shapes and random weights (std 0.02), for speed and memory work."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty() allocates the shared weight twice: tie it again
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    model.inv_freq = rope_inv_freq(config).to(device)
    return model.to(dtype).eval()


def save_model(model: Transformer, out_dir: str | Path) -> None:
    """Write config.json and model.safetensors (a tied lm_head is stored once, as Hugging Face does)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(model.config.to_hf_dict(dtype), indent=2) + "\n")


def model_hash(model_dir: str | Path) -> str:
    """sha256 over config.json and every weight shard, in name order: identifies a build's source."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for path in [model_dir / "config.json", *_shards(model_dir)]:
        h.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


__all__ = ["CheckpointError", "ModelConfigError", "load_model", "model_hash", "random_model", "save_model"]
