"""The loader's errors: each names the file and says what to do."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from partition.checkpoint import CheckpointError, load_model, random_model, save_model
from partition.config import PRESETS, ModelConfigError, preset


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_roundtrip_keeps_weights(tiny_checkpoint: Path) -> None:
    a = load_model(tiny_checkpoint)
    b = random_model(a.config, seed=7)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied stays tied after load


def test_unsupported_architecture_lists_supported(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(d)


def test_truncated_shard_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    shard = d / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        load_model(d)


def test_missing_shard_from_index_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(d)


def test_sharded_checkpoint_loads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    from safetensors.torch import load_file
    state = load_file(d / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    (d / "model.safetensors").unlink()
    save_file({k: state[k] for k in names[:half]}, str(d / "a.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(d / "b.safetensors"))
    weight_map = {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(load_model(d).model.norm.weight, state["model.norm.weight"])


def test_unloadable_dtype_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    from safetensors.torch import load_file
    state = load_file(d / "model.safetensors")
    state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=torch.int8)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight.*I8.*F32, F16, BF16"):
        load_model(d)


def test_missing_weights_are_listed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    from safetensors.torch import load_file
    state = load_file(d / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight"):
        load_model(d)


def test_no_weights_mentions_bin(tmp_path: Path, tiny_checkpoint: Path) -> None:
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="convert it to safetensors"):
        load_model(tmp_path)


def test_presets_have_real_parameter_counts() -> None:
    # Published sizes: Llama-3-8B 8.03 B, Llama-3.2-1B 1.24 B, Qwen2.5-7B 7.62 B, Mistral-7B 7.25 B.
    published = {"llama-3-8b": 8.03e9, "llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9,
                 "qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9, "mistral-7b": 7.25e9}
    assert set(published) == set(PRESETS)
    for name, n in published.items():
        assert abs(preset(name).n_params - n) / n < 0.02, name
    with pytest.raises(ModelConfigError, match="llama-3-8b"):
        preset("gpt-5")


def test_save_then_load_preserves_config(tmp_path: Path) -> None:
    cfg = preset("llama-3.2-1b")
    small = type(cfg)(**{**cfg.to_dict(), "rope_scaling": cfg.rope_scaling, "vocab_size": 100,
                         "hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
                         "intermediate_size": 64, "eos_token_ids": (1,)})
    save_model(random_model(small), tmp_path)
    assert load_model(tmp_path).config == small
