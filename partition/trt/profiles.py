"""Optimisation profiles of a slice engine: the (min, opt, max) shape of every dynamic input for the
two profiles TensorRT builds, prefill (profile 0) and decode (profile 1). Pure Python: the API builder,
the trtexec command line, the engine cache key and the runner's profile choice all read it.

The graph's dynamic dims are B (rows), T (new tokens) and P (past slots) (partition.build.export).
  prefill: T from 2 to `max_prefill`, P from 0 (a fresh prompt binds an empty past) to `max_seq` (a
           prompt that continues a sequence binds the whole cache: the mask hides unwritten slots);
  decode:  T = 1, P from 1 to `max_seq` (the runner binds its whole preallocated cache, P = max_seq).
Every `past_*` input gets the same P range, so TensorRT sees one consistent past length per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the manifest's record of a graph input; export.py itself loads torch and onnx
    from partition.build.export import TensorSpec

PREFILL, DECODE = 0, 1  # profile indices, in build order
PROFILE_NAMES = ("prefill", "decode")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ProfileLimits:
    """What the engine must accept: rows, cache length, longest prompt chunk, and the shapes to tune."""

    max_batch: int
    max_seq: int
    max_prefill: int
    opt_batch: int = 1
    opt_prefill: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.opt_batch <= self.max_batch:
            raise ValueError(f"opt_batch {self.opt_batch} is not within 1..max_batch {self.max_batch}")
        if not 2 <= self.max_prefill <= self.max_seq:
            raise ValueError(f"max_prefill {self.max_prefill} must be within 2..max_seq {self.max_seq} "
                             "(a prefill step has T >= 2; T = 1 runs in the decode profile)")

    def dims(self) -> tuple[dict[str, tuple[int, int, int]], dict[str, tuple[int, int, int]]]:
        """(min, opt, max) of each symbolic dim, for the prefill and the decode profile."""
        b = (1, self.opt_batch, self.max_batch)
        opt_t = max(2, min(self.opt_prefill, self.max_prefill))
        prefill = {"B": b, "T": (2, opt_t, self.max_prefill), "P": (0, 0, self.max_seq)}
        decode = {"B": b, "T": (1, 1, 1), "P": (1, self.max_seq, self.max_seq)}
        return prefill, decode


@dataclass(frozen=True)
class InputRange:
    """One dynamic input's shapes in one profile."""

    name: str
    min: Shape
    opt: Shape
    max: Shape


@dataclass(frozen=True)
class ShapeProfile:
    """One TensorRT optimisation profile: the min / opt / max shape of every dynamic input (not a power profile)."""
    name: str
    inputs: tuple[InputRange, ...]

    def shape(self, name: str, which: str) -> Shape:
        return getattr(next(i for i in self.inputs if i.name == name), which)


def _resolve(spec: TensorSpec, dims: dict[str, tuple[int, int, int]]) -> InputRange:
    out: list[list[int]] = [[], [], []]
    for d in spec.shape:
        if isinstance(d, int):
            vals = (d, d, d)
        elif d in dims:
            vals = dims[d]
        else:
            raise ValueError(f"input {spec.name!r}: dynamic dim {d!r} has no profile range (known: "
                             f"{', '.join(sorted(dims))})")
        for k in range(3):
            out[k].append(vals[k])
    return InputRange(spec.name, tuple(out[0]), tuple(out[1]), tuple(out[2]))


def build_profiles(inputs: Sequence[TensorSpec], limits: ProfileLimits) -> tuple[ShapeProfile, ShapeProfile]:
    """The prefill and decode profiles for a slice's graph inputs (from its manifest entry): every input
    with a symbolic dim gets a range, in graph order, including each past_key_i / past_value_i."""
    dynamic = [s for s in inputs if any(isinstance(d, str) for d in s.shape)]
    prefill, decode = limits.dims()
    return (ShapeProfile(PROFILE_NAMES[PREFILL], tuple(_resolve(s, prefill) for s in dynamic)),
            ShapeProfile(PROFILE_NAMES[DECODE], tuple(_resolve(s, decode) for s in dynamic)))


def profile_for(t: int) -> int:
    """The profile a step of T new tokens runs in."""
    return DECODE if t == 1 else PREFILL


def shape_text(shape: Shape) -> str:
    """trtexec's form of a shape: 1x2x3."""
    return "x".join(str(d) for d in shape)


def profiles_key(profiles: Sequence[ShapeProfile]) -> str:
    """A canonical text of the profiles, part of the engine cache key."""
    return ";".join(f"{p.name}:" + ",".join(f"{i.name}={shape_text(i.min)}/{shape_text(i.opt)}/{shape_text(i.max)}"
                                            for i in p.inputs) for p in profiles)
