"""Model shapes by name: a preset of partition.config (the one list of model definitions) as the
:class:`power.physics.costmodel.ModelShape` the cost model takes. The physics never sees a name: the
runtime, the benchmark and the CLIs resolve one here, the service passes the served model's own shape."""
from __future__ import annotations

from partition.config import PRESETS
from power.physics.costmodel import ModelShape, shape_of


class UnknownShape(KeyError, ValueError):
    """A shape name that is no preset: a KeyError for lookups, a ValueError (a bad argument) for the CLIs'
    one error wrapper; its text is the message alone."""

    def __str__(self) -> str:
        return str(self.args[0])


def model_shape(name: str) -> ModelShape:
    """A named shape: one of partition.config's presets (UnknownShape naming the known ones otherwise)."""
    if name in PRESETS:
        return shape_of(name, PRESETS[name])
    raise UnknownShape(f"unknown model shape {name!r}; known: {', '.join(sorted(PRESETS))}")
