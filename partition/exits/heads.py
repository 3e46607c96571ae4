"""Exit heads: per exit layer, an affine "translator" h -> A h + b (initialised to the identity) read
out through the model's own final norm and LM head, so a head adds d*(d+1) parameters and nothing
else (tuned lens, arXiv 2303.08112; LayerSkip and CALM read exits through the shared head too).

Stored beside the model: `exits.safetensors` (A and b per layer, fp16) and `exits.json`, the record
(layers, training data and steps, held-out agreement, and the calibrations `orin-agent calibrate`
adds: target disagreement -> per-layer thresholds).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from partition.model import RMSNorm, Transformer

HEADS_FILE = "exits.safetensors"
RECORD_FILE = "exits.json"


class ExitHeadsError(ValueError):
    """Missing or unusable exit heads; the message names the file and what to do."""


class ExitHeads(nn.Module):
    """Next-token logits from the hidden state after layer l, for each l in `layers`."""

    def __init__(self, model: Transformer, layers: tuple[int, ...]) -> None:
        super().__init__()
        n, d = model.config.n_layers, model.config.hidden_size
        if not layers or any(not 0 < l < n for l in layers) or list(layers) != sorted(set(layers)):
            raise ExitHeadsError(f"exit layers {layers} must be increasing, distinct and inside 1..{n - 1}")
        self.layers = tuple(layers)
        param = next(model.parameters())
        eye = torch.eye(d, dtype=param.dtype, device=param.device)
        self.weight = nn.ParameterDict({str(l): nn.Parameter(eye.clone()) for l in layers})
        self.bias = nn.ParameterDict({str(l): nn.Parameter(torch.zeros(d, dtype=param.dtype, device=param.device))
                                      for l in layers})
        # The shared read-out, frozen: not registered as submodules so they are neither trained nor saved.
        self._norm: tuple[RMSNorm, nn.Linear] = (model.model.norm, model.lm_head)

    def translate(self, layer: int, h: Tensor) -> Tensor:
        """(.., D) hidden state after `layer` -> (.., D) its estimate of the last layer's state."""
        return h @ self.weight[str(layer)].T + self.bias[str(layer)]

    def forward(self, layer: int, h: Tensor) -> Tensor:
        """(.., D) -> float32 logits (.., V)."""
        norm, lm_head = self._norm
        return lm_head(norm(self.translate(layer, h))).float()

    def only(self, layers: tuple[int, ...]) -> "ExitHeads":
        """These heads restricted to `layers` (a subset of theirs), sharing their parameters: e.g. the
        exits a device can take when the layers after its split run on an edge server."""
        missing = [l for l in layers if l not in self.layers]
        if missing:
            raise ExitHeadsError(f"no exit heads at layers {missing} (heads: {self.layers})")
        out = copy.copy(self)
        out.layers = tuple(layers)
        return out

    def save(self, model_dir: Path) -> Path:
        state = {f"{kind}.{l}": p.detach().to(torch.float16).contiguous().cpu()
                 for kind, table in (("weight", self.weight), ("bias", self.bias)) for l, p in table.items()}
        path = Path(model_dir) / HEADS_FILE
        save_file(state, str(path), metadata={"layers": ",".join(map(str, self.layers))})
        return path


def load_heads(model: Transformer, model_dir: str | Path) -> ExitHeads:
    """The exit heads saved beside `model_dir`'s model, in the model's dtype and device."""
    path = Path(model_dir) / HEADS_FILE
    if not path.is_file():
        raise ExitHeadsError(f"{path}: no exit heads beside this model; train them with "
                             f"`orin-agent train-exits --model {model_dir}`")
    try:
        state = load_file(str(path))
    except SafetensorError as exc:
        raise ExitHeadsError(f"{path}: unreadable ({exc}); train the heads again") from None
    layers = tuple(sorted(int(k.split(".")[1]) for k in state if k.startswith("weight.")))
    heads = ExitHeads(model, layers)
    param = next(model.parameters())
    with torch.no_grad():
        for l in layers:
            heads.weight[str(l)].copy_(state[f"weight.{l}"].to(param.dtype))
            heads.bias[str(l)].copy_(state[f"bias.{l}"].to(param.dtype))
    return heads.requires_grad_(False).eval()


@dataclass(frozen=True)
class Calibration:
    """Per-layer confidence thresholds (top-1 probability of the exit head) for one target."""

    target: float  # the disagreement with the full model that was asked for
    confidence: float  # 1 - delta of the Learn-then-Test guarantee
    thresholds: dict[int, float]  # exit layer -> lowest certified threshold (inf: never exit there)
    # exit layer -> share of held-out tokens that left there with these thresholds (empty: not measured)
    exit_rates: dict[int, float] = field(default_factory=dict)


def read_record(model_dir: str | Path) -> dict[str, object]:
    path = Path(model_dir) / RECORD_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ExitHeadsError(f"{path}: not JSON ({exc}); train the heads again") from None
    if not isinstance(data, dict):
        raise ExitHeadsError(f"{path}: expected a JSON object")
    return data


def write_record(model_dir: str | Path, record: dict[str, object]) -> Path:
    path = Path(model_dir) / RECORD_FILE
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def calibrations(model_dir: str | Path) -> list[Calibration]:
    """Every calibration in the record, lowest target first."""
    out = []
    for c in read_record(model_dir).get("calibrations", []):  # type: ignore[union-attr]
        th = {int(k): (float("inf") if v is None else float(v)) for k, v in c["thresholds"].items()}
        rates = dict(c.get("held_out", {}).get("exit_rate_per_layer", {}))
        out.append(Calibration(float(c["target"]), float(c["confidence"]), th,
                               {int(l): float(r) for l, r in rates.items() if int(l) in th}))
    return sorted(out, key=lambda c: c.target)


def pick_calibration(model_dir: str | Path, max_disagreement: float) -> Calibration | None:
    """The calibration with the largest target <= max_disagreement (None: none is that strict, so
    the caller runs full depth, which always meets the target)."""
    fits = [c for c in calibrations(model_dir) if c.target <= max_disagreement + 1e-12]
    return fits[-1] if fits else None
