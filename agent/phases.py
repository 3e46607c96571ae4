"""Phase listeners: what hears the engine's phase events, between steps.

Before each step `EngineCore` tells its `PhaseListener` what the step is (an
`agent.engine.types.PhaseEvent`): a prefill of `n_tokens` prompt tokens (compute-bound), a decode of
`batch` sequences whose longest context is `context` tokens (memory-bound), or idle (nothing to run).
The power controller (power.runtime.controller) and the twin's driver listen here; `NullListener` changes
nothing, `RecordingListener` keeps the events (tests, benchmarks) and `FanOut` puts several behind one.

Listeners are called on the engine thread, between steps: they must return quickly (hand the event
to their own thread if they do I/O).
"""
from __future__ import annotations

import threading
from typing import Protocol

from agent.engine.types import PhaseEvent

__all__ = ["PhaseEvent", "PhaseListener", "NullListener", "RecordingListener", "FanOut"]


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
