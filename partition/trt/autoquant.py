"""`--precision auto` end to end on CPU: a round-to-nearest `LayerQuantizer` built on partition.quantize
(fake quantisation: each Linear weight of one decoder layer is quantised and dequantised through the
reference path of kernels.weight_only, then restored), the calibration text (a held-out slice of the
shipped model's test split, sha256-checked against corpus.json), and the run that measures the
sensitivities, chooses the plan within a perplexity budget (partition.trt.autoplan), measures the plan
as a whole and writes it as JSON beside the build's manifest.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from kernels.weight_only import dequantize
from partition.checkpoint import load_model
from partition.quantize import default_spec, quantize_weight
from partition.tokenizer import Tokenizer
from partition.trt.autoplan import Sensitivity, choose_plan, measure_plan, measure_sensitivities, perplexity

BITS = {"int8-wo": 8, "int4-wo": 4}
PLAN_FILE = "precision_plan.json"


@contextlib.contextmanager
def rtn_layer_quantizer(layer: nn.Module, precision: str) -> Iterator[None]:
    """Swap every nn.Linear weight of `layer` for its RTN-quantised value (INT8 symmetric per channel or
    INT4 asymmetric groups of 128, partition.quantize.default_spec), dequantised; restore on exit."""
    if precision not in BITS:
        raise ValueError(f"weight-only precision {precision!r} is not one of {', '.join(BITS)}")
    spec = default_spec(BITS[precision])
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    saved = [m.weight.detach().clone() for m in linears]
    try:
        with torch.no_grad():
            for m in linears:
                q, s, z = quantize_weight(m.weight, spec)
                k = q.shape[1]
                g_idx = torch.arange(k) // (k if spec.group_size == -1 else spec.group_size)
                m.weight.copy_(dequantize(q, s.float(), z, g_idx).to(m.weight.dtype))
        yield
    finally:
        with torch.no_grad():
            for m, w in zip(linears, saved):
                m.weight.copy_(w)


def held_out_text(model_dir: Path, n_chars: int) -> str:
    """The first `n_chars` of the model's held-out test split: corpus.json's files whose split is "test",
    read from the recorded stdlib folder or this interpreter's, used only where the sha256 matches."""
    corpus_file = model_dir / "corpus.json"
    if not corpus_file.is_file():
        raise FileNotFoundError(f"{corpus_file} is missing: --precision auto calibrates on the model's held-out "
                                "text, which corpus.json lists")
    corpus = json.loads(corpus_file.read_text())
    roots = [Path(corpus["stdlib_dir"]), Path(sysconfig.get_paths()["stdlib"])]
    parts: list[str] = []
    size = 0
    for rec in corpus["files"]:
        if rec["split"] != "test" or rec["path"].startswith("encodings/"):
            continue
        for root in roots:
            path = root / rec["path"]
            if path.is_file():
                raw = path.read_bytes()
                if hashlib.sha256(raw).hexdigest() == rec["sha256"]:
                    parts.append(raw.decode("utf-8"))
                    size += len(parts[-1])
                    break
        if size >= n_chars:
            return "".join(parts)[:n_chars]
    raise FileNotFoundError(f"only {size} of {n_chars} characters of the held-out test files listed in "
                            f"{corpus_file} were found with matching sha256 under {', '.join(map(str, roots))}")


def calibration_ids(ids: list[int], rows: int, seq: int) -> torch.Tensor:
    """`rows` windows of seq + 1 tokens (each token predicted from its window)."""
    if len(ids) < rows * (seq + 1):
        raise ValueError(f"{len(ids)} calibration tokens are fewer than {rows} x {seq + 1}")
    return torch.tensor(ids[:rows * (seq + 1)], dtype=torch.long).reshape(rows, seq + 1)


@dataclass(frozen=True)
class AutoResult:
    plan: dict[str, str]  # layer index -> precision, every layer listed
    plan_key: str
    budget: float  # relative perplexity increase allowed (0.01 = 1 %)
    base_perplexity: float
    measured_increase: float  # the whole plan applied at once
    predicted_increase: float  # summed per-layer increases
    weight_bytes: int
    fp16_bytes: int
    calibration_tokens: int
    sensitivities: tuple[Sensitivity, ...]

    @property
    def bytes_ratio(self) -> float:
        return self.weight_bytes / self.fp16_bytes

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["sensitivities"] = [asdict(s) for s in self.sensitivities]
        data["bytes_ratio"] = self.bytes_ratio
        data["quantiser"] = "rtn: int8-wo symmetric per channel, int4-wo asymmetric group 128 (partition.quantize)"
        return data


def auto_precision(model_dir: Path, budget: float, rows: int = 16, seq: int = 128,
                   ids: torch.Tensor | None = None) -> AutoResult:
    """Measure, choose and check a per-layer weight-only plan for the checkpoint in `model_dir` (fp32, CPU)."""
    if budget < 0:
        raise ValueError(f"the perplexity budget must be >= 0, not {budget}")
    model = load_model(model_dir, dequantize=True).eval()  # a GGUF file: measured from its dequantised weights
    if ids is None:
        tok = Tokenizer.from_dir(model_dir, model.config)
        ids = calibration_ids(tok.encode(held_out_text(model_dir, rows * (seq + 1) * 8)), rows, seq)
    sens = measure_sensitivities(model, ids, tuple(BITS), rtn_layer_quantizer)
    auto = choose_plan(sens, model.config, budget)
    measured = measure_plan(model, ids, auto.plan, rtn_layer_quantizer)
    layers = dict(auto.plan.layers)
    return AutoResult({str(i): layers.get(i, auto.plan.default) for i in range(model.config.n_layers)},
                      auto.plan.key(), budget, perplexity(model, ids), measured, auto.predicted_increase,
                      auto.weight_bytes, auto.fp16_bytes, ids.numel() - ids.shape[0], tuple(sens))


def write_plan(result: AutoResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PLAN_FILE
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return path


def parse_budget(text: str) -> float:
    """"1%" -> 0.01, "0.01" -> 0.01."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"--max-ppl-increase {text!r}: give a percentage (1%) or a fraction (0.01)") from None
    if value < 0:
        raise ValueError(f"--max-ppl-increase {text!r} must be >= 0")
    return value
