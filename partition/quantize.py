"""Weight-only quantisation of checkpoints: round-to-nearest group-wise INT8 / INT4, the GPTQ and AWQ
on-disk layouts (pack, unpack), writing a quantised checkpoint folder and loading one back into the
one model definition with `kernels.weight_only.QuantLinear` in place of each quantised `nn.Linear`.

Layouts (safetensors, one set of tensors per quantised linear `P`, weight W of shape (N out, K in)):
  GPTQ (AutoGPTQ / transformers "gptq", checkpoint_format "gptq"): P.qweight int32 (K * bits / 32, N),
    codes packed along K, code j of a word at bits [j*bits, (j+1)*bits); P.qzeros int32
    (G, N * bits / 32) packed along N the same way, storing zero - 1 (the v1 format's offset;
    "gptq_v2" stores the zero itself); P.scales fp16 (G, N); P.g_idx int32 (K,) = group of column k.
  AWQ (AutoAWQ "awq", version "gemm", 4 bits): P.qweight int32 (K, N / 8) packed along N in the
    interleaved order 0, 2, 4, 6, 1, 3, 5, 7; P.qzeros int32 (G, N / 8) likewise (no offset);
    P.scales fp16 (G, N).
  weight = (code - zero) * scale. config.json carries `quantization_config` (quant_method, bits,
  group_size, sym, desc_act, checkpoint_format / version).

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from kernels.weight_only import QuantLinear
from partition.config import ModelConfig, load_config
from partition.model import Transformer, rope_inv_freq

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order of 8 INT4 codes in a word (awq/utils/packing_utils.py)
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
        raise ValueError(f"in_features {k} is not a multiple of the group size {gs}")
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


def _pack_rows(x: Tensor, bits: int) -> Tensor:
    """Pack codes (R, C) along dim 0 into int32 words (R * bits / 32, C), code j at bits j*bits."""
    per = 32 // bits
    r, c = x.shape
    if r % per:
        raise ValueError(f"{r} rows do not pack into 32-bit words of {per} codes")
    x = x.to(torch.int64).reshape(r // per, per, c)
    shifts = torch.arange(per, dtype=torch.int64, device=x.device)[None, :, None] * bits
    words = (x << shifts).sum(1)  # (R / per, C), < 2^32
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _unpack_rows(words: Tensor, bits: int) -> Tensor:
    """Inverse of _pack_rows: int32 (R', C) -> codes (R' * 32 / bits, C) int32."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=w.device)[None, :, None] * bits
    codes = (w[:, None, :] >> shifts) & (2 ** bits - 1)  # (R', per, C)
    return codes.reshape(-1, words.shape[1]).to(torch.int32)


def pack_gptq(q: Tensor, scales: Tensor, zeros: Tensor, bits: int, group_size: int) -> dict[str, Tensor]:
    """Canonical (N, K) codes, (N, G) scales and zeros -> the GPTQ v1 tensors of one linear layer."""
    n, k = q.shape
    gs = k if group_size == -1 else group_size
    return {"qweight": _pack_rows(q.T, bits),
            "qzeros": _pack_rows((zeros.to(torch.int64) - 1) & (2 ** bits - 1), bits).T.contiguous(),  # (G, N/per)
            "scales": scales.T.contiguous().half(),
            "g_idx": (torch.arange(k) // gs).to(torch.int32)}


def unpack_gptq(t: dict[str, Tensor], bits: int, v2: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GPTQ tensors -> codes (N, K), scales (N, G), zeros (N, G), g_idx (K,)."""
    q = _unpack_rows(t["qweight"], bits).T  # (N, K)
    zeros = _unpack_rows(t["qzeros"].T.contiguous(), bits)  # (N, G)
    if not v2:
        zeros = zeros + 1  # v1 stores zero - 1
    scales = t["scales"].T
    k = q.shape[1]
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[1])
    return q, scales, zeros, g_idx.to(torch.int32)


def pack_awq(q: Tensor, scales: Tensor, zeros: Tensor) -> dict[str, Tensor]:
    """Canonical INT4 -> AutoAWQ GEMM tensors (for tests and conversions)."""
    def pack_cols(x: Tensor) -> Tensor:  # (R, N) -> (R, N / 8), interleaved
        r, n = x.shape
        x = x.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)
        return _pack_rows(x.T, 4).T.contiguous()
    return {"qweight": pack_cols(q.T), "qzeros": pack_cols(zeros.T), "scales": scales.T.contiguous().half()}


def unpack_awq(t: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """AutoAWQ GEMM tensors -> codes (N, K), scales (N, G), zeros (N, G), g_idx (K,)."""
    inverse = [AWQ_ORDER.index(i) for i in range(8)]

    def unpack_cols(words: Tensor) -> Tensor:  # (R, N / 8) -> (R, N)
        x = _unpack_rows(words.T.contiguous(), 4).T  # (R, N), still interleaved
        r, n = x.shape
        return x.reshape(r, n // 8, 8)[:, :, inverse].reshape(r, n)
    q, zeros, scales = unpack_cols(t["qweight"]).T, unpack_cols(t["qzeros"]).T, t["scales"].T
    k = q.shape[1]
    return q, scales, zeros, (torch.arange(k) // (k // scales.shape[1])).to(torch.int32)


def _quantised_linears(model: Transformer, lm_head: bool = False) -> list[tuple[str, nn.Linear]]:
    """The decoder layers' projections (embeddings and lm_head stay in floating point, as GPTQ/AWQ
    checkpoints keep them; lm_head=True adds it, as gpt-fast does, when it is not tied)."""
    out = [(f"model.{name}", m) for name, m in model.model.named_modules() if isinstance(m, nn.Linear)]
    if lm_head and not model.config.tie_word_embeddings:
        out.append(("lm_head", model.lm_head))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def quantize_model(model: Transformer, spec: QuantSpec, reference: bool = False, lm_head: bool = False) -> Transformer:
    """In memory: every decoder projection (and lm_head if asked) becomes a QuantLinear on the model's
    device and dtype; the float weights are freed."""
    dtype = next(model.parameters()).dtype
    for name, lin in _quantised_linears(model, lm_head):
        q, s, z = quantize_weight(lin.weight, spec)
        k = q.shape[1]
        g_idx = torch.arange(k, device=q.device) // (k if spec.group_size == -1 else spec.group_size)
        _replace(model, name, QuantLinear(q, s, z, g_idx, spec.bits, k if spec.group_size == -1 else spec.group_size,
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
    from partition.checkpoint import _shards, load_model

    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out_dir} is the source checkpoint; pick another folder")
    model = load_model(model_dir)
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
                        sum(p.stat().st_size for p in _shards(model_dir)),
                        (out_dir / "model.safetensors").stat().st_size, round(time.perf_counter() - t0, 2))


def quantization_config(model_dir: Path) -> dict | None:
    """config.json's quantization_config, or None for a floating-point checkpoint."""
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    qc = raw.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def refuse_export(model_dir: str | Path) -> None:
    """ONNX export of quantised slices is not implemented: say so before any exporter runs."""
    from partition.checkpoint import CheckpointError

    qc = quantization_config(Path(model_dir))
    if qc is not None:
        raise CheckpointError(f"{model_dir}: a {qc.get('quant_method')} {qc.get('bits')}-bit checkpoint cannot be "
                              "exported to ONNX yet (quantised slices run on the torch backend only): use "
                              "--backend torch, or export the unquantised checkpoint")


def load_quantized(model_dir: Path, qcfg: dict, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """A GPTQ / AWQ checkpoint as a Transformer whose quantised projections are QuantLinear."""
    from partition.checkpoint import CheckpointError, _shards

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
    tensors: dict[str, Tensor] = {}
    for shard in _shards(model_dir):
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{shard}: unreadable safetensors file ({exc}); download it again") from None
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if f"{name}.qweight" not in tensors:
            continue
        parts = {k: tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{k}" in tensors}
        q, s, z, g = unpack_gptq(parts, bits, v2) if method == "gptq" else unpack_awq(parts)
        if q.shape != (lin.out_features, lin.in_features):
            raise CheckpointError(f"{model_dir}: {name} unpacks to {tuple(q.shape)}, config.json says "
                                  f"{(lin.out_features, lin.in_features)}")
        bias = tensors.pop(f"{name}.bias", None)
        gs = lin.in_features // s.shape[1]
        _replace(model, name, QuantLinear(q.to(device), s.to(device), z.to(device), g.to(device), bits, gs,
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
