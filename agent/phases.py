"""The phase-event seam between the engine loop and the power controller.

The engine loop tells a `PhaseListener` what the next step is before it runs it: a prefill of
`n_tokens` prompt tokens (compute-bound), a decode of `batch` sequences whose longest context is
`context` tokens (memory-bound), or idle (nothing to run). The power controller (issue 4) plugs in
here and picks clocks per phase; until it exists the service runs with `NullListener`.

Listeners are called on the engine thread, between steps: they must return quickly (hand the event
to their own thread if they do I/O).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Protocol

PhaseKind = Literal["prefill", "decode", "idle"]


@dataclass(frozen=True)
class PhaseEvent:
    kind: PhaseKind
    t: float  # time.monotonic() on the engine thread
    n_tokens: int = 0  # prefill: prompt tokens in this step
    context: int = 0  # decode: the longest context (tokens in the KV-cache) of the batch
    batch: int = 0  # sequences in this step


class PhaseListener(Protocol):
    def on_phase(self, event: PhaseEvent) -> None:
        ...


class NullListener:
    """No power controller: phases are observed (metrics) but change nothing on the board."""

    def on_phase(self, event: PhaseEvent) -> None:
        return None


class RecordingListener:
    """Keeps every event (tests, benchmarks); thread-safe to read while the engine runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[PhaseEvent] = []

    def on_phase(self, event: PhaseEvent) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[PhaseEvent]:
        with self._lock:
            return list(self._events)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


class FanOut:
    """Several listeners behind one (the metrics gauge and the power controller, say)."""

    def __init__(self, *listeners: PhaseListener) -> None:
        self.listeners = listeners

    def on_phase(self, event: PhaseEvent) -> None:
        for listener in self.listeners:
            listener.on_phase(event)
