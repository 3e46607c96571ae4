"""Checkpoint folders: load a Hugging Face folder (config.json, one or many *.safetensors, tokenizer.json)
into the one model definition, build random-weight models from presets, and save folders back.
A folder whose config.json has `quantization_config` (GPTQ / AWQ, the layouts of
partition/quant_format.py) is loaded here too, its projections as `kernels.weight_only.QuantLinear`;
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

from partition.config import DTYPE_NAMES, ModelConfig, ModelConfigError, load_config
from partition.model import Transformer, rope_inv_freq
from partition.quant_format import quantization_config, replace_module, unpack_awq, unpack_gptq

LOADABLE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# `--dtype`: the float parts' dtype (weights kept in floating point, activations, the KV-cache). Default
# fp32, measured on SmolLM2-135M Q4_1 on the CPU (docs/BENCHMARKS.md, "GGUF on the CPU"): bf16 moved the
# top-1 token at 2.7 % (float) / 4.4 % (INT4) of a held-out text's positions, fp16 was no faster than fp32.
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16)))


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and what to do."""


def shards(model_dir: Path) -> list[Path]:
    """The files that hold a checkpoint folder's weights: its safetensors shards by name (those its
    index lists, when it has one), or the GGUF file of a GGUF model folder."""
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
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for shard in files:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} is missing; "
                                      "download the complete checkpoint")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (pytorch_model.bin is not loaded: convert it to safetensors)" if any(
            model_dir.glob("*.bin")) else ""
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found{hint}")
    return files


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
    qcfg = quantization_config(model_dir)
    if qcfg is not None:  # GPTQ / AWQ weights: projections become kernels.weight_only.QuantLinear
        return load_quantized(model_dir, qcfg, dtype, device)
    with torch.device("meta"):
        model = Transformer(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # tied checkpoints store the embedding once
    state: dict[str, torch.Tensor] = {}
    for shard in shards(model_dir):
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


def load_quantized(model_dir: Path, qcfg: dict, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """A GPTQ / AWQ checkpoint as a Transformer whose quantised projections are QuantLinear."""
    from kernels.weight_only import QuantLinear

    method, bits = str(qcfg.get("quant_method", "")).lower(), int(qcfg.get("bits", 0))
    if method not in ("gptq", "awq") or bits not in (4, 8) or (method == "awq" and bits != 4):
        raise CheckpointError(f"{model_dir}: quantization_config {method!r} with {bits} bits is not supported "
                              "(supported: gptq 4/8 bits, awq 4 bits)")
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise CheckpointError(f"{model_dir}: AWQ version {qcfg.get('version')!r}: only the GEMM layout is supported")
    v2 = str(qcfg.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    config: ModelConfig = load_config(model_dir)
    with torch.device("meta"):
        model = Transformer(config)
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(model_dir):
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{shard}: unreadable safetensors file ({exc}); download it again") from None
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]:
        if f"{name}.qweight" not in tensors:
            continue
        parts = {k: tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{k}" in tensors}
        q, s, z, g = unpack_gptq(parts, bits, v2) if method == "gptq" else unpack_awq(parts)
        if q.shape != (lin.out_features, lin.in_features):
            raise CheckpointError(f"{model_dir}: {name} unpacks to {tuple(q.shape)}, config.json says "
                                  f"{(lin.out_features, lin.in_features)}")
        bias = tensors.pop(f"{name}.bias", None)
        gs = lin.in_features // s.shape[1]
        replace_module(model, name, QuantLinear(q.to(device), s.to(device), z.to(device), g.to(device), bits, gs,
                                          bias=None if bias is None else bias.to(device), dtype=dtype))
    expected = {k for k, v in model.state_dict().items() if v.is_meta}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    state = {k: tensors[k].to(device=device, dtype=dtype) for k in expected if k in tensors}
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
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
    for path in [model_dir / "config.json", *shards(model_dir)]:
        h.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


__all__ = ["DTYPES", "CheckpointError", "ModelConfigError", "load_model", "parse_dtype", "load_quantized", "model_hash", "random_model",
           "save_model", "shards"]
