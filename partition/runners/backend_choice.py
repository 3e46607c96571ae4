"""Which runner a model gets when the user names none (`--backend auto`, the default of `generate` and
`serve`): the fastest one measured for that kind of model on that kind of device, among those that can
serve what was asked.

Rule (measurements: docs/BENCHMARKS.md, "CPU weight-only decode"; scripts/bench_peer.py):
  * a block-quantised model (a GGUF file, or a GPTQ / AWQ checkpoint) on the CPU, one slice, no feature
    only the torch runner has (early exits, speculation, a paged or INT8 KV-cache, an edge split)
    -> "ort": the one-graph ONNX Runtime decoder (partition/build/ort_decoder.py: MatMulNBits with int8
    activations, GroupQueryAttention). SmolLM2-135M Q4_1 on the 2-core x86 machine: torch eager with
    tinygemm INT4 kernels runs ~30 ops per layer from Python; the graph runs one session call per token.
  * everything else -> "torch" (the reference runner; CUDA graphs on a GPU).
`choose_backend` returns the choice with the reason, so `generate --json` and the service's log can say
why.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str


def choose_backend(model: str | Path, device: str = "cpu", slices: str | None = None, kv_cache: str = "fp16",
                   kv_blocks: int | None = None, exits: bool = False, edge: bool = False) -> BackendChoice:
    """The backend `auto` stands for, for this model and these options (module docstring)."""
    from partition.build.decoder_build import is_quantized

    if not is_quantized(model):
        return BackendChoice("torch", "a floating-point checkpoint: the torch runner")
    if device != "cpu":
        return BackendChoice("torch", f"a quantised model on {device}: the torch runner's GPU kernels")
    blockers = [name for name, on in (("--slices", bool(slices) and slices.count(",") > 0),
                                      ("--kv-cache int8", kv_cache != "fp16"), ("--kv-blocks", kv_blocks is not None),
                                      ("exits / speculation", exits), ("--edge", edge)) if on]
    if blockers:
        return BackendChoice("torch", f"a quantised model with {', '.join(blockers)}: torch-runner features")
    if importlib.util.find_spec("onnxruntime") is None:
        return BackendChoice("torch", "onnxruntime is not installed (pip install onnxruntime)")
    return BackendChoice("ort", "a quantised model on the CPU: the ONNX Runtime decoder graph (MatMulNBits, "
                                "GroupQueryAttention)")


def resolve_backend(backend: str | None, model: str | Path, device: str = "cpu", slices: str | None = None,
                    kv_cache: str = "fp16", kv_blocks: int | None = None, exits: bool = False,
                    edge: bool = False) -> str:
    """`backend` as given, or the choice for `auto` / None."""
    if backend not in (None, AUTO):
        return backend  # type: ignore[return-value]
    return choose_backend(model, device, slices, kv_cache, kv_blocks, exits, edge).backend
