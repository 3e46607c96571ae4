"""The decoder graph of partition/build/ort_decoder.py, built once per model and cached: from a GGUF
file's codes (partition/gguf, without torch), a GPTQ / AWQ checkpoint's codes, or a float checkpoint.

Cache: <cache_dir>/decoder-<key>/decoder.onnx with its weights in decoder.onnx.data beside it
(external data, page-aligned by onnx for the large tensors, so ONNX Runtime maps them instead of
holding a second copy while it prepacks: 185 MB peak over the interpreter instead of 237 for
SmolLM2-135M Q4_1 in one file, docs/BENCHMARKS.md). The key covers the source (the GGUF file's path,
size and mtime, or partition.checkpoint.model_hash of a folder), FORMAT and the accuracy level; the
.onnx is written last, so a folder with it is complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from partition.build.ort_decoder import ACCURACY_FP32, ACCURACY_INT8, ACCURACY_NATIVE, ACCURACY_SPLIT, \
    DecoderWeights, QuantWeight, build_decoder, weights_from_gguf
from partition.digest import sha256
from partition.paths import cache_root

FORMAT = 12  # bump when the graph's contract or structure changes: old cached graphs are then rebuilt
GRAPH = "decoder.onnx"
MAX_ROPE = 1 << 17  # rotary cache rows are cheap (64 floats each for head_dim 128): cover any context


def default_cache_dir() -> Path:
    return cache_root() / "builds"


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file behind `model` (a .gguf path, or the model folder partition.gguf.folder made for one)."""
    from partition.gguf.folder import ALIASES, alias_file, gguf_source

    if str(model) in ALIASES:
        return alias_file(str(model)).resolve()
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    return gguf_source(path) if path.is_dir() else None


def is_quantized(model: str | Path) -> bool:
    """A GGUF model or a checkpoint folder with a quantization_config: what the decoder graph is for."""
    if gguf_file(model) is not None:
        return True
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return isinstance(json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config"), dict)
    except json.JSONDecodeError:
        return False


def weights_size(model: Path) -> int:
    """Bytes of the model's weight files on disk (the GGUF, or the folder's safetensors shards): what a session of
    its decoder graph holds, to the first order."""
    g = gguf_file(model)
    return g.stat().st_size if g is not None else sum(p.stat().st_size for p in model.glob("*.safetensors"))


def _source_key(model: Path) -> str:
    g = gguf_file(model)
    if g is not None:
        st = g.stat()
        return f"gguf|{g}|{st.st_size}|{st.st_mtime_ns}"
    # partition.checkpoint.model_hash's inputs (config.json and the weight shards, in name order), read without
    # importing the checkpoint loader (torch): a cached graph must load on a torch-free path
    h = sha256()
    for path in [model / "config.json", *sorted(model.glob("*.safetensors"))]:
        h.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return f"dir|{h.hexdigest()}"


def decoder_weights(model: str | Path) -> DecoderWeights:
    """The model's weights as numpy for build_decoder: GGUF codes, GPTQ / AWQ codes, or floats."""
    g = gguf_file(model)
    if g is not None:
        return weights_from_gguf(g)
    return _checkpoint_weights(Path(model))


def _checkpoint_weights(model_dir: Path) -> DecoderWeights:
    """A checkpoint folder's tensors: GPTQ / AWQ projections unpacked to codes (partition/quant_format.py),
    everything else as float32 arrays. Act-order groups (a permuted g_idx) have no MatMulNBits form."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from partition.build.ort_decoder import LayerWeights
    from partition.checkpoint import CheckpointError, shards
    from partition.config import load_config
    from partition.quant_format import quantization_config, unpack_awq, unpack_gptq

    cfg = load_config(model_dir)
    qc = quantization_config(model_dir) or {}
    method, bits = str(qc.get("quant_method", "")).lower(), int(qc.get("bits", 0) or 0)
    v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(model_dir):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)

    def lin(name: str) -> object:
        if f"{name}.qweight" in tensors:
            parts = {k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{k}" in tensors}
            q, sc, z, g = unpack_gptq(parts, bits, v2) if method == "gptq" else unpack_awq(parts)
            k = q.shape[1]
            group = k // sc.shape[1]
            if not torch.equal(g.long(), torch.arange(k) // group):
                raise CheckpointError(f"{model_dir}: {name} is act-ordered (desc_act); the decoder graph needs "
                                      "sequential groups: use --backend torch")
            return QuantWeight(bits, q.to(torch.uint8).numpy(), sc.float().numpy(), z.to(torch.int32).numpy(), None, group)
        if f"{name}.weight" not in tensors:
            raise CheckpointError(f"{model_dir}: {name}.weight is missing")
        return tensors[f"{name}.weight"].float().numpy()

    def vec(name: str) -> np.ndarray:
        return tensors[name].float().numpy()

    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        bias = (tuple(vec(f"{p}.self_attn.{n}_proj.bias") for n in "qkv") if cfg.qkv_bias else None)
        layers.append(LayerWeights(*(lin(f"{p}.{n}") for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                               "mlp.down_proj")),  # type: ignore[arg-type]
                                   vec(f"{p}.input_layernorm.weight"), vec(f"{p}.post_attention_layernorm.weight"), bias))
    embed = vec("model.embed_tokens.weight")
    head = None if cfg.tie_word_embeddings else lin("lm_head")
    return DecoderWeights(cfg, embed, layers, vec("model.norm.weight"), head, str(model_dir))  # type: ignore[arg-type]


# Activation precision of the decoder graph's weight-only matmuls (MatMulNBits accuracy_level per projection).
# Every precision runs an 8-bit head as candidates from a 4-bit copy (int8 activations) with its 32 highest logits
# recomputed exactly (ort_decoder._rescored_head). Agreement = greedy tokens equal to the dequantised float model's
# at every teacher-forced position of four texts, 2137 positions (SmolLM2-135M Q4_1: tests/data/teacher_forced.txt
# and three held-out ones, scripts/greedy_agreement.py; docs/BENCHMARKS.md):
#   "fp32": fp32 activations (level 0) in every layer (8-bit codes: the split input x = x_hi + x_lo through the
#           int8 kernel, ort_decoder._Graph.linear): 100 % on every text.
#   "mixed": int8 activations in the fused gate/up projection only (half of a layer's weights), fp32 elsewhere:
#           99.0 % on teacher_forced.txt, but 97.8 % on code and 98.7 % over all four (AVX-512 machines; 98.1 % on
#           teacher_forced.txt on an AVX2-only AMD EPYC, 2026-12-06).
#   "int8": int8 activations everywhere (level 4, MLAS's VNNI kernels), ~25 % less CPU per token here, 96.8 %
#           over all four
#           (llama.cpp, which also quantises activations to 8 bits: 97.1 % on teacher_forced.txt).
#   "split": every 4-bit projection through the int8 kernel on two rows, x and x - int8(x) (ort_decoder._Graph
#           ._split_input): 100 % on every text (2026-12-06), the int8 kernel's speed plus ~11 small nodes per
#           layer input; faster than "fp32" where MLAS's fp32 kernel is slow (AVX2 without AVX-512: 12.6 against
#           17.1 ms a SmolLM2 step on a 2-core AMD EPYC, docs/BENCHMARKS.md).
#   "native": every 4- and 8-bit projection through orin-agent's own exact operator (kernels/ort_q4.c: fp32
#           activations, one node per projection, the MLP's activation inside the gate/up node, o and down with the
#           residual add and the next norm), built with the machine's C compiler on first use; offered only where
#           it builds (`exact_precisions`): 100 % on every text (2026-12-07).
#   "auto" (the default): the faster of the exact ones, measured once per model and machine
#           (partition/runners/precision_choice.py).
PRECISIONS: dict[str, tuple[int | dict[str, int], int]] = {
    "fp32": (ACCURACY_FP32, 32), "mixed": ({"default": ACCURACY_FP32, "gate_up": ACCURACY_INT8}, 32),
    "int8": (ACCURACY_INT8, 32), "split": (ACCURACY_SPLIT, 32), "native": (ACCURACY_NATIVE, 32)}
EXACT_PRECISIONS = ("fp32", "split", "native")  # greedy tokens equal to the dequantised model's on all 2137 positions


def exact_precisions() -> tuple[str, ...]:
    """EXACT_PRECISIONS this machine can run: "native" only where kernels/ort_q4.c builds."""
    from kernels import ort_q4

    return tuple(p for p in EXACT_PRECISIONS if p != "native" or ort_q4.library() is not None)
DEFAULT_PRECISION = "fp32"


def ensure_decoder(model: str | Path, precision: str = DEFAULT_PRECISION, cache_dir: str | Path | None = None,
                   log: Callable[[str], None] | None = None) -> Path:
    """The cached decoder graph of `model` at `precision` (PRECISIONS; built on first use, with a line on `log`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"decoder precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    accuracy_level, rescore = PRECISIONS[precision]
    model = Path(model)
    key = sha256(f"{FORMAT}|{precision}|{_source_key(model)}".encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"decoder-{key}"
    if (folder / GRAPH).is_file():
        return folder / GRAPH
    import onnx

    if log:
        log(f"building the ONNX Runtime decoder graph of {model.name} (once; cached in {folder})")
    weights = decoder_weights(model)
    proto = build_decoder(weights, min(MAX_ROPE, max(weights.config.max_position_embeddings, 2048)), accuracy_level,
                          rescore_top=rescore)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".decoder-", dir=root))
    try:
        onnx.save_model(proto, str(tmp / GRAPH), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=GRAPH + ".data", size_threshold=4096)
        (tmp / "source.json").write_text(json.dumps({"model": str(model), "format": FORMAT,
                                                     "precision": precision}, indent=2) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:  # another process built it first
            if not (folder / GRAPH).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / GRAPH


def weight_bytes(weights: DecoderWeights, precision: str = DEFAULT_PRECISION) -> dict[str, int]:
    """Bytes one decode step streams, by part (codes + scales + minimums / zero points as stored). A rescored
    8-bit head (the precision's rescore count, ort_decoder._rescored_head) reads its 4-bit candidate copy and
    that many of its own rows. "native": a 4-bit weight the operator takes reads its codes and a half-precision
    scale and minimum per group (kernels/ort_q4.py), the candidate copy too."""
    from kernels import ort_q4
    from partition.build.ort_decoder import _gatherable, candidate_head

    native = PRECISIONS[precision][0] == ACCURACY_NATIVE

    def nbytes(w: object) -> int:
        if isinstance(w, QuantWeight):
            n, k = w.codes.shape
            if native and ort_q4.accepts(n, k, w.bits, w.group, w.scales, w.mins, w.zeros):
                return w.codes.size * w.bits // 8 + 4 * w.scales.size
            return w.codes.size * w.bits // 8 + sum(a.nbytes for a in (w.scales, w.zeros, w.mins) if a is not None)
        return int(getattr(w, "nbytes", 0))

    layers = sum(nbytes(getattr(lw, n)) for lw in weights.layers for n in ("q", "k", "v", "o", "gate", "up", "down"))
    head_w = weights.head if weights.head is not None else weights.embed
    rescore = PRECISIONS[precision][1]
    if rescore and _gatherable(head_w):
        assert isinstance(head_w, QuantWeight)
        head = nbytes(candidate_head(head_w, half=native)) + rescore * nbytes(head_w) // head_w.shape[0]
    else:
        head = nbytes(head_w)
    return {"layers": layers, "head": head, "total": layers + head}
