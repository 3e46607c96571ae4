"""The service's engine thread: one thread that owns an `EngineCore` and calls its `step()` while
there is work, and the thread-safe inbox through which HTTP handlers reach it.

`submit()` checks the prompt, then the queue bound atomically (a full queue is refused at once with
`QueueFull`), and puts the request on the inbox; results come back through the request's `sink`, a
callable the engine calls from its thread (the API hands in one that forwards to an asyncio queue).
`cancel()` also goes through the inbox. The core itself never sees a thread or a sink.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from agent.engine.core import EngineCore
from agent.engine.types import (PRIORITIES, EngineStopped, Finished, InvalidRequest, QueueFull,
                                RequestOutput, SamplingParams, SeqRequest, Usage, check_prompt,
                                next_request_id)
from power.policy.phase import PhaseEvent

log = logging.getLogger("orin_agent.engine")

Sink = Callable[[object], None]


class EngineLoop:
    def __init__(self, core: EngineCore, *, max_queue: int = 64, on_tick: Callable[[], None] | None = None) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.max_queue = max_queue
        self.on_tick = on_tick
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # Reentrant: SIGTERM's handler (Service.begin_shutdown -> stop_accepting) runs on the main thread
        # between two bytecodes, possibly inside submit's critical section on that same thread.
        self._lock = threading.RLock()
        # Requests submitted and not finished. The bound is the cache slots plus max_queue, so a
        # request that would get a free slot at once is never refused.
        self._inflight = 0
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # -- the API side (any thread) -------------------------------------------------------------
    @property
    def max_seq(self) -> int:
        return self.core.max_seq

    @property
    def phase(self) -> str:
        return self.core.phase

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def queue_depth(self) -> int:
        return max(0, self._inflight - self.scheduler.num_running)

    @property
    def in_flight(self) -> int:
        return self._inflight

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *,
               priority: str = "interactive", req_id: str | None = None) -> str:
        """Queue a request; raises QueueFull (retry later), InvalidRequest (never runnable) or
        EngineStopped. Results go to `sink` (called on the engine thread)."""
        if priority not in PRIORITIES:
            raise InvalidRequest(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}", "priority")
        check_prompt(prompt_ids, self.max_seq)
        rid = req_id or next_request_id()
        req = SeqRequest(rid, tuple(prompt_ids), params, PRIORITIES[priority])
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the service is shutting down")
            if self._inflight >= self.max_queue + self.core.executor.max_batch:
                raise QueueFull(self._inflight - self.core.executor.max_batch, retry_after_s=1)
            self._inflight += 1
        self._inbox.put(("submit", (req, sink, time.monotonic())))
        self._wake.set()
        return rid

    def cancel(self, req_id: str) -> None:
        self._inbox.put(("cancel", req_id))
        self._wake.set()

    def end_all(self, message: str) -> None:
        """End every request now with finish reason "shutdown" (the API answers 503 / an SSE error
        event), e.g. when the shutdown grace period is over."""
        self._inbox.put(("end_all", message))
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    @property
    def accepting(self) -> bool:
        """False once the service began to stop: new requests are answered 503."""
        return self._accepting

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (True), or the timeout passed (False)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.in_flight == 0:
                return True
            time.sleep(0.02)
        return self.in_flight == 0

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still running end with finish reason "cancelled"."""
        self.stop_accepting()
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.on_tick:
                    self.on_tick()
                self._drain_inbox()
                self._route(self.core.step())
                if self.core.metrics:
                    self.core.metrics.on_queue(self.queue_depth, self.scheduler.num_running)
                if not self.core.has_work():
                    self.core.set_phase(PhaseEvent("idle", batch=0, t=time.monotonic()))
                    self._wake.wait(0.5)
                    self._wake.clear()
        finally:
            self._drain_inbox()
            for rid in list(self._sinks):
                self._route(self.core.abort(rid))
            self.core.set_phase(PhaseEvent("idle", batch=0, t=time.monotonic()))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                req, sink, t = arg  # type: ignore[misc]
                try:
                    self.core.add_request(req, t)
                except (InvalidRequest, QueueFull) as exc:  # checked at submit; kept for safety
                    with self._lock:
                        self._inflight -= 1
                    self._send(sink, Finished("error", _no_usage(req), str(exc)))
                    continue
                self._sinks[req.req_id] = sink
            elif kind == "cancel":
                self._route(self.core.abort(str(arg)))
            elif kind == "end_all":
                for rid in list(self._sinks):
                    self._route(self.core.abort(rid, "shutdown", str(arg)))

    def _route(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            sink = self._sinks.get(o.req_id)
            if sink is None:
                continue
            if isinstance(o.event, Finished):
                del self._sinks[o.req_id]
                with self._lock:
                    self._inflight -= 1
            self._send(sink, o.event)

    @staticmethod
    def _send(sink: Sink, event: object) -> None:
        try:
            sink(event)
        except RuntimeError:  # the consumer's event loop is gone (client or server shut down)
            pass


def _no_usage(req: SeqRequest) -> Usage:
    return Usage(len(req.prompt_ids), 0, None, None, None, 0.0)
