"""The engine's phase listeners: what hears its phase events between steps.

Before each step `EngineCore` tells its listener what the step is (a `power.policy.phase.PhaseEvent`:
prefill, decode or idle) and asks it how many rows the step may run (`max_rows`: the power budget's
batch limit, through the same protocol). The protocol and the event are defined once, in
power.policy.phase; the power controller (power.runtime.controller) and the twin's driver implement it
on the board's side. Here: `NullListener` changes nothing, `RecordingListener` keeps the events (tests,
benchmarks) and `FanOut` puts several behind one.

Listeners are called on the engine thread, between steps: they must return quickly (hand the event
to their own thread if they do I/O).
"""
from __future__ import annotations

import threading

from power.policy.phase import PhaseEvent, PhaseListener

__all__ = ["PhaseListener", "NullListener", "RecordingListener", "FanOut"]


class NullListener(PhaseListener):
    """No power controller: phases are observed (metrics) but change nothing on the board."""


class RecordingListener(PhaseListener):
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


class FanOut(PhaseListener):
    """Several listeners behind one (the metrics gauge and the power controller, say): each hears every
    event; the rows allowed are the tightest limit any of them sets."""

    def __init__(self, *listeners: PhaseListener) -> None:
        self.listeners = listeners

    def on_phase(self, event: PhaseEvent) -> None:
        for listener in self.listeners:
            listener.on_phase(event)

    def max_rows(self, engine_max: int) -> int | None:
        limits = [n for n in (listener.max_rows(engine_max) for listener in self.listeners) if n is not None]
        return min(limits) if limits else None
