"""Every TensorRT name the builder and runner touch exists in the real Python bindings of the version
the double stands for: the names recorded while driving partition.trt against tests/fake_tensorrt.py
are looked up in the strings of the registry's binding wheels (`tensorrt_bindings-8.6.1` for 8.x, no
8.5 wheel exists there, and `tensorrt_cu12_bindings-10.3.0`), which hold the pybind module but not the
libraries. The wheels are downloaded once into ~/.cache/orin-agent/test-wheels; offline, skipped.

Plus the real-TensorRT check (marked `tensorrt`, skipped without TensorRT and a GPU): engines built
from the same slices give ORT's greedy tokens."""
from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fake_tensorrt import make_fake
from partition.build import build_slices
from partition.checkpoint import random_model, save_model
from partition.config import ModelConfig
from partition.trt import engines as engines_mod
from partition.trt.cache import EngineCache
from partition.trt.engines import Device, EngineOptions, build_engines
from partition.trt.precision import PrecisionPlan
from partition.trt.profiles import ProfileLimits
from partition.trt.runner import TrtRunner

WHEELS = {"8": ("tensorrt-bindings==8.6.1", "3.10"), "10": ("tensorrt-cu12-bindings==10.3.0", "3.11")}
CACHE = Path.home() / ".cache" / "orin-agent" / "test-wheels"
CFG = ModelConfig("LlamaForCausalLM", 320, 64, 4, 4, 2, 16, 128, max_position_embeddings=64)


def _binding_words(major: str) -> set[str]:
    req, py = WHEELS[major]
    name = req.split("==")[0].replace("-", "_")
    found = sorted(CACHE.glob(f"{name}-{req.split('==')[1]}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--python-version", py, "--platform", "manylinux_2_17_x86_64", req, "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=180)
        found = sorted(CACHE.glob(f"{name}-*.whl"))
        if proc.returncode != 0 or not found:
            pytest.skip(f"cannot download {req} (offline?): {proc.stderr.strip().splitlines()[-1:]}")
    with zipfile.ZipFile(found[0]) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith(".so")))
    return {w.decode() for w in re.findall(rb"[A-Za-z_][A-Za-z0-9_]*", data)}


@pytest.mark.parametrize("version", ["8.5.2", "10.3.0"])
def test_every_name_used_exists_in_the_real_bindings(version: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    words = _binding_words(version.split(".")[0])
    assert {"execute_async_v3", "set_input_shape", "build_serialized_network"} <= words  # the wheel is real
    model = tmp_path / "model"
    save_model(random_model(CFG, seed=4), model)
    manifest = build_slices(model, "0:2,2:4", tmp_path / "b", verify=False)
    trt = make_fake(version)
    monkeypatch.setattr(engines_mod, "load_tensorrt", lambda: trt)
    limits = ProfileLimits(max_batch=1, max_seq=16, max_prefill=8)
    built = build_engines(tmp_path / "b", manifest, EngineOptions(PrecisionPlan("fp16"), limits, optimization_level=3),
                          EngineCache(tmp_path / "e"), device=Device("Orin", "sm_87", 8 << 30))
    for e, s in zip(built, manifest.slices):
        r = TrtRunner(e.engine, s.spec, s.inputs, s.outputs, (CFG.n_kv_heads, CFG.head_dim), 16, 1, "cpu", trt)
        r.run(np.zeros((1, 2), np.int32) if s.spec.is_first else np.zeros((1, 2, CFG.hidden_size), np.float32),
              np.array([[0, 1]], np.int32))
    used = trt.recorder.names
    assert {"execute_async_v3", "set_tensor_address", "set_shape", "set_memory_pool_limit"} <= used
    assert sorted(used - words) == [], f"names not in the TensorRT {version} bindings"


@pytest.mark.tensorrt
@pytest.mark.cuda
def test_trt_tokens_equal_ort_tokens(tmp_path: Path) -> None:
    from partition.runners import load_chain

    model = tmp_path / "model"
    save_model(random_model(CFG, seed=5), model)
    prompt = np.array([[1, 5, 9, 2, 7]], np.int32)

    def greedy(backend: str, device: str) -> list[int]:
        chain = load_chain(model, backend, slices="0:2,2:4", max_seq=32, device=device, build_dir=tmp_path / "b")
        logits = chain.forward(prompt, np.arange(5, dtype=np.int32)[None])
        toks = [int(np.asarray(logits.cpu() if hasattr(logits, "cpu") else logits).argmax())]
        for i in range(8):
            logits = chain.forward(np.array([[toks[-1]]], np.int32), np.array([[5 + i]], np.int32))
            toks.append(int(np.asarray(logits.cpu() if hasattr(logits, "cpu") else logits).argmax()))
        return toks

    assert greedy("trt", "cuda") == greedy("ort", "cpu")
