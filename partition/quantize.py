"""The offline weight-only quantiser: round-to-nearest group-wise INT8 / INT4 of a model's decoder
projections, in memory (`quantize_model`, each `nn.Linear` becoming a `kernels.weight_only.QuantLinear`)
or as a checkpoint folder in the GPTQ layout (`quantize_checkpoint`, what `orin-agent quantize` writes).
The layouts are partition/quant_format.py's; loading a quantised folder back is partition/checkpoint.py's.

`quantize` writes GPTQ: INT8 symmetric per output channel (group_size -1), INT4 asymmetric with groups
of 128 by default, plain round-to-nearest (no calibration; no AWQ scale search yet).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from kernels.weight_only import QuantLinear
from partition.checkpoint import CheckpointError, load_model, shards
from partition.model import Transformer
from partition.quant_format import pack_gptq, quantization_config, replace_module

TOKENIZER_FILES = ("generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
FP16_TINY = 2.0 ** -14  # smallest normal fp16: scales are stored in fp16 and must not flush to 0


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int  # -1 = one group per output channel
    sym: bool

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"--bits must be 4 or 8, not {self.bits}")
        if self.group_size != -1 and self.group_size < 8:
            raise ValueError(f"--group must be -1 (per channel) or >= 8, not {self.group_size}")


def default_spec(bits: int, group_size: int | None = None) -> QuantSpec:
    """INT8: symmetric per channel (the int8pack kernel's layout); INT4: asymmetric, groups of 128."""
    if bits == 8:
        return QuantSpec(8, -1 if group_size is None else group_size, sym=True)
    return QuantSpec(bits, 128 if group_size is None else group_size, sym=False)


def quantize_weight(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest: w (N, K) -> codes (N, K) uint8, scales (N, G) fp16, zeros (N, G) int32."""
    n, k = w.shape
    gs = k if spec.group_size == -1 else spec.group_size
    if k % gs:
        fits = [g for g in (128, 64, 32) if k % g == 0]
        raise ValueError(f"in_features {k} is not a multiple of the group size {gs}"
                         + (f": pass --group {fits[0]}" if fits else ": pass --group -1 (per channel)"))
    maxq = 2 ** spec.bits - 1
    wg = w.detach().float().reshape(n, k // gs, gs)
    if spec.sym:  # zero in the middle; amax maps to +-(2^(bits-1) - 1), so nothing is clipped
        scales = wg.abs().amax(-1) / (2 ** (spec.bits - 1) - 1)
        zeros = torch.full_like(scales, 2 ** (spec.bits - 1), dtype=torch.int32)
    else:  # the range [min(w, 0), max(w, 0)] over maxq steps
        hi = wg.amax(-1).clamp(min=0)
        # lo <= -hi / (maxq - 1) keeps the zero >= 1: the GPTQ v1 format stores zero - 1 in `bits` bits
        lo = torch.minimum(wg.amin(-1).clamp(max=0), -hi / (maxq - 1))
        scales = (hi - lo) / maxq
    # fp16 on disk: round the scale up (fp16 keeps 11 bits) so the range still fits the codes
    scales = (scales.clamp(min=FP16_TINY) * (1 + 2.0 ** -10)).half()
    if not spec.sym:
        zeros = torch.round(-lo / scales.float()).clamp(1, maxq).to(torch.int32)
    q = torch.round(wg / scales.float()[..., None]) + zeros[..., None]
    return q.clamp(0, maxq).to(torch.uint8).reshape(n, k), scales, zeros


def _quantised_linears(model: Transformer, lm_head: bool = False) -> list[tuple[str, nn.Linear]]:
    """The decoder layers' projections (embeddings and lm_head stay in floating point, as GPTQ/AWQ
    checkpoints keep them; lm_head=True adds it, as gpt-fast does, when it is not tied)."""
    out = [(f"model.{name}", m) for name, m in model.model.named_modules() if isinstance(m, nn.Linear)]
    if lm_head and not model.config.tie_word_embeddings:
        out.append(("lm_head", model.lm_head))
    return out


def quantize_model(model: Transformer, spec: QuantSpec, reference: bool = False, lm_head: bool = False) -> Transformer:
    """In memory: every decoder projection (and lm_head if asked) becomes a QuantLinear on the model's
    device and dtype; the float weights are freed."""
    dtype = next(model.parameters()).dtype
    for name, lin in _quantised_linears(model, lm_head):
        q, s, z = quantize_weight(lin.weight, spec)
        k = q.shape[1]
        g_idx = torch.arange(k, device=q.device) // (k if spec.group_size == -1 else spec.group_size)
        replace_module(model, name, QuantLinear(q, s, z, g_idx, spec.bits, k if spec.group_size == -1 else spec.group_size,
                                          bias=lin.bias, dtype=dtype, reference=reference))
    return model


@dataclass(frozen=True)
class QuantSummary:
    out_dir: str
    bits: int
    group_size: int
    sym: bool
    layers_quantised: int
    source_bytes: int
    quantised_bytes: int
    seconds: float


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, spec: QuantSpec) -> QuantSummary:
    """Quantise a checkpoint folder and write it in the GPTQ layout (plus its tokenizer files)."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out_dir} is the source checkpoint; pick another folder")
    model = load_model(model_dir, dequantize=True)  # a GGUF file: re-quantised from its dequantised weights
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError(f"{model_dir} is already quantised")
    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    linears = _quantised_linears(model)
    for name, lin in linears:
        del state[f"{name}.weight"]
        q, s, z = quantize_weight(lin.weight, spec)
        state.update({f"{name}.{k}": v for k, v in pack_gptq(q, s, z, spec.bits, spec.group_size).items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_hf_dict("float16")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size,
                                  "sym": spec.sym, "desc_act": False, "checkpoint_format": "gptq",
                                  "true_sequential": True, "damp_percent": 0.0,
                                  "tool": "orin-agent quantize (round-to-nearest)"}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in model_dir.iterdir():  # tokenizer and generation files
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES):
            shutil.copy2(f, out_dir / f.name)
    return QuantSummary(str(out_dir), spec.bits, spec.group_size, spec.sym, len(linears),
                        sum(p.stat().st_size for p in shards(model_dir)),
                        (out_dir / "model.safetensors").stat().st_size, round(time.perf_counter() - t0, 2))


def refuse_export(model_dir: str | Path) -> None:
    """ONNX export of quantised slices is not implemented: say so before any exporter runs."""
    qc = quantization_config(Path(model_dir))
    if qc is not None:
        raise CheckpointError(f"{model_dir}: a {qc.get('quant_method')} {qc.get('bits')}-bit checkpoint cannot be "
                              "exported to ONNX yet (quantised slices run on the torch backend only): use "
                              "--backend torch, or export the unquantised checkpoint")
