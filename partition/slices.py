"""Slice geometry: `SliceSpec` (layers [start, end) of a model) and the helpers that parse, cut and
check a tiling of a model's layers into slices. Pure Python: the exporter, the build, the runners and
the CLI all import it, and it imports nothing from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SliceSpec:
    """Layers [start, end) of a model with n_layers_total layers."""

    start: int
    end: int
    n_layers_total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.n_layers_total:
            raise ValueError(f"slice {self.start}:{self.end} is not a non-empty range inside 0:{self.n_layers_total}")

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.n_layers_total

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def parse_slices(text: str, n_layers: int) -> list[SliceSpec]:
    """'0:4,4:8' -> slices; they must be contiguous and cover every layer exactly once."""
    specs: list[SliceSpec] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            a, b = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"slice {part!r} is not of the form START:END (e.g. 0:4,4:8)") from None
        specs.append(SliceSpec(a, b, n_layers))
    check_tiling(specs, n_layers)
    return specs


def even_slices(n_layers: int, n_slices: int) -> list[SliceSpec]:
    """`n_slices` contiguous slices of (nearly) equal size covering `n_layers` layers."""
    if not 1 <= n_slices <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_slices} slices")
    cuts = [round(i * n_layers / n_slices) for i in range(n_slices + 1)]
    return [SliceSpec(a, b, n_layers) for a, b in zip(cuts, cuts[1:])]


def check_tiling(specs: Sequence[SliceSpec], n_layers: int) -> None:
    """Raise ValueError unless `specs` are contiguous from layer 0 and end at `n_layers`."""
    pos = 0
    for s in specs:
        if s.start != pos:
            raise ValueError(f"slices must be contiguous from layer 0: expected one starting at {pos}, got {s}")
        pos = s.end
    if pos != n_layers:
        raise ValueError(f"slices end at layer {pos} but the model has {n_layers} layers")
