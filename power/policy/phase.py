"""The engine's phase event and the listener protocol it travels through: the one seam between the engine
and the board.

Before each step the engine (agent.engine.core) tells its listener what the step is: a prefill of
``n_tokens`` prompt tokens (compute-bound), a decode of ``batch`` sequences whose longest context is
``context`` tokens (memory-bound), or idle (nothing to run). The DVFS policy decides on it
(``power.policy.dvfs``), the service's controller thread (power.runtime.controller) queues it, the twin's
real-time driver (power.twin.driver) loads its model with it, the energy benchmark replays it in virtual
time. Defined here, in the lowest layer that needs it; plain data, standard library only.

The protocol runs both ways through one object: :meth:`PhaseListener.on_phase` carries the event to the
board's side, :meth:`PhaseListener.max_rows` carries the power budget's batch limit back to the
scheduler (read by the engine before each step). Both are called on the engine thread, between steps:
they must return at once (a listener that does I/O hands the event to its own thread).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PhaseKind = Literal["prefill", "decode", "idle"]


@dataclass(frozen=True)
class PhaseEvent:
    kind: PhaseKind
    n_tokens: int = 0       # prefill: prompt tokens in this step
    context: int = 0        # cache positions in use after this step, the longest row (0: not told); a
    #                         prefill chunk of a long prompt attends to the positions before it
    batch: int = 1          # sequences in this step (the engine says 0 for idle)
    t: float = 0.0          # time.monotonic() on the engine thread (a virtual-time replay passes its own clock apart)


class PhaseListener:
    """What hears the engine's phase events. The defaults change nothing: a listener overrides what it
    needs (every listener is one of these, so the engine calls both methods on any of them)."""

    def on_phase(self, event: PhaseEvent) -> None:
        """The step about to run (or idle)."""

    def max_rows(self, engine_max: int) -> int | None:
        """The decode rows the engine may run in its next step (None: this listener sets no limit)."""
        return None
