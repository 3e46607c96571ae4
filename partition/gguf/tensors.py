"""A GGUF file's tensors as the one model definition (partition/model.py, Hugging Face parameter names):
names mapped, llama.cpp's rope permutation of Q and K undone, block-quantised projections kept as
codes (`QuantLinear`), float tensors as they are.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) reorders the rows of each head of
q_proj and k_proj (weight and bias) from Hugging Face's rotate-half layout, (2, head_dim / 2), to
interleaved pairs, (head_dim / 2, 2), because its rope rotates adjacent pairs; the reverse is
transformers' LlamaTensorProcessor._reverse_permute_weights. Without it the model still produces
fluent text with logits off by up to ~20 (tests/test_gguf_model.py checks both ways). The
permutation acts on output rows only and every quantisation group lies inside one row, so it is
applied to the codes and group parameters directly, exactly.

Kept as codes: Q4_0 / Q4_1 / Q4_K as group-wise INT4 (groups of 32; Q4_1 / Q4_K with float group
minimums), Q8_0 as group-wise INT8; F32 / F16 / BF16 as floats in the model dtype; any other block
type is dequantised to the model dtype with one notice naming the types (partition/gguf/quants.py).
A quantised token embedding becomes a `QuantEmbedding`; a tied one shares the output head's codes.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import ReaderTensor
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from kernels.quant_embedding import QuantEmbedding
from kernels.weight_only import QuantLinear
from partition.gguf.quants import FLOAT, GROUP, KEPT, Unpacked, float_array, unpack
from partition.gguf.reader import GGUFError, GGUFModel, read_model
from partition.model import Transformer, rope_inv_freq

log = logging.getLogger("orin_agent.gguf")

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# read by partition/gguf/reader.py (Llama-3 rope scaling) or not model weights at all
_NOT_WEIGHTS = ("rope_freqs.weight",)


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> the Hugging Face parameter name, or None for a tensor this model has no slot for."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rope permutation: hf = gguf[rows]. Per head, GGUF row
    (d, i) (pair d, member i) holds Hugging Face row (i, d)."""
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)


def _rows_order(hf: str, g: GGUFModel, undo_permutation: bool) -> np.ndarray | None:
    if not (g.permuted_qk and undo_permutation):
        return None
    cfg = g.config
    if ".self_attn.q_proj." in hf:
        return unpermute_rows(cfg.n_heads * cfg.head_dim, cfg.n_heads)
    if ".self_attn.k_proj." in hf:
        return unpermute_rows(cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads)
    return None


def _float_tensor(t: ReaderTensor, kind: QT, rows: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    arr = float_array(kind, t.data) if kind in FLOAT else gguf_dequantize(np.asarray(t.data), kind)
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return arr[rows] if rows is not None else arr


def _quant_linear(u: Unpacked, dtype: torch.dtype, device: str | torch.device, bias: torch.Tensor | None,
                  reference: bool = False) -> QuantLinear:
    to = (lambda a: None if a is None else torch.from_numpy(a).to(device))
    k = u.codes.shape[1]
    g_idx = torch.arange(k, device=device) // GROUP
    return QuantLinear(to(u.codes), to(u.scales), to(u.zeros), g_idx, u.bits, GROUP, bias=bias, dtype=dtype,
                       reference=reference, mins=to(u.mins))


def _quant_embedding(u: Unpacked, dtype: torch.dtype, device: str | torch.device) -> QuantEmbedding:
    to = (lambda a: None if a is None else torch.from_numpy(a).to(device))
    return QuantEmbedding(to(u.codes), to(u.scales), to(u.zeros), GROUP, dtype, mins=to(u.mins))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def load_gguf_model(source: str | Path | GGUFModel, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", dequantize: bool = False,
                    undo_permutation: bool = True) -> Transformer:
    """The GGUF model as a Transformer in eval mode: Q4_0 / Q4_1 / Q4_K / Q8_0 projections as QuantLinear
    (codes kept), other tensors in `dtype`. dequantize: every tensor as floats instead (ONNX export,
    re-quantisation, comparisons). undo_permutation=False keeps llama.cpp's Q/K row order (wrong: for
    the test that shows the permutation matters)."""
    g = source if isinstance(source, GGUFModel) else read_model(source)
    cfg = g.config
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    by_name: dict[str, tuple[ReaderTensor, QT]] = {}
    for t in g.reader.tensors:
        hf = hf_name(t.name)
        if hf is None:
            if t.name in _NOT_WEIGHTS:
                continue
            raise GGUFError(f"{g.path}: tensor {t.name!r} has no place in a {cfg.architecture} model; this file's "
                            "architecture differs from what its metadata says")
        if hf not in shapes:
            raise GGUFError(f"{g.path}: tensor {t.name} ({hf}) does not fit the model its metadata describes")
        want = shapes[hf]
        if tuple(int(x) for x in reversed(t.shape)) != want:  # GGUF lists ggml's (ne0 = K, ne1 = N)
            raise GGUFError(f"{g.path}: tensor {t.name} has shape {tuple(reversed(t.shape))}, the metadata "
                            f"implies {want}")
        by_name[hf] = (t, QT(t.tensor_type))
    inflated: Counter[str] = Counter()
    state: dict[str, torch.Tensor] = {}
    quantised: dict[str, Unpacked] = {}
    for hf, (t, kind) in by_name.items():
        rows = _rows_order(hf, g, undo_permutation)
        shape = shapes[hf]
        if len(shape) == 2 and kind in KEPT and not dequantize:
            u = unpack(kind, t.data, *shape)
            quantised[hf] = u.take_rows(rows) if rows is not None else u
            continue
        if kind not in FLOAT and not dequantize:
            inflated[kind.name] += 1
        state[hf] = torch.from_numpy(_float_tensor(t, kind, rows, shape)).to(device=device, dtype=dtype)
    if inflated:
        log.warning("%s: %s dequantised to %s (blocks kept as codes: %s)", g.path.name,
                    ", ".join(f"{n} {k} tensor{'s' if n > 1 else ''}" for k, n in sorted(inflated.items())),
                    str(dtype).removeprefix("torch."), ", ".join(q.name for q in KEPT))
    embed = "model.embed_tokens.weight"
    tied_head: QuantLinear | None = None
    for hf, u in quantised.items():
        if hf == embed:
            continue
        module = hf.removesuffix(".weight")
        bias = state.pop(f"{module}.bias", None)
        _replace(model, module, _quant_linear(u, dtype, device, bias))
    if embed in quantised:
        u = quantised[embed]
        if cfg.tie_word_embeddings:
            tied_head = _quant_linear(u, dtype, device, None)
            model.lm_head = tied_head
        model.model.embed_tokens = (QuantEmbedding.sharing(tied_head) if tied_head is not None and
                                    tied_head.kernel == "reference" else _quant_embedding(u, dtype, device))
    expected = {k for k, v in model.state_dict().items() if v.is_meta}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise GGUFError(f"{g.path}: tensors missing from the file: {', '.join(missing[:5])}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings and embed in state:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def layout(model: Transformer) -> dict[str, str]:
    """Which kernel holds each quantised module ({'model.layers.0.self_attn.q_proj': 'int4pack_cpu', ...})."""
    return {name: getattr(m, "kernel", "gather") for name, m in model.named_modules()
            if isinstance(m, (QuantLinear, QuantEmbedding))}
