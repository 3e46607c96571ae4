"""The engine loop: one thread that owns the scheduler and the executor and runs one step at a time.

    plan = scheduler.schedule()            # plain dataclasses (agent.scheduler)
    listener.on_phase(prefill|decode|idle) # the power controller's seam (agent.phases)
    out  = executor.execute(plan)          # the chain of slices (agent.executor)
    events = scheduler.update(plan, out)   # tokens -> text deltas, stop strings, usage, energy

HTTP handlers talk to it through thread-safe queues: `submit()` puts the request on the inbox (after
an atomic check of the queue bound, so a full queue is refused at once with `QueueFull`) and results
come back through the request's `sink`, a callable the engine calls from its thread (the API hands
in one that forwards to an asyncio queue). `cancel()` also goes through the inbox.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from agent.generation import SamplingParams, StopMatcher
from agent.phases import NullListener, PhaseEvent, PhaseListener
from agent.scheduler import (PRIORITIES, QueueFull, RequestRejected, Scheduler, SeqRequest, StepOutput,
                             StepPlan, TokenEvent, next_request_id)
from partition.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger("orin_agent.engine")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    energy_joules: float | None  # None where the board has no power rails
    ttft_s: float | None
    decode_tok_s: float | None
    duration_s: float


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length", "cancelled", "error"
    usage: Usage
    message: str = ""


class Executor(Protocol):
    max_batch: int
    max_seq: int

    def execute(self, plan: StepPlan) -> StepOutput:
        ...


class EngineStopped(RuntimeError):
    """The engine is shutting down (or stopped) and takes no new requests."""


class EngineMetrics(Protocol):
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_token(self, latency_s: float) -> None: ...
    def on_step(self, plan: StepPlan, elapsed_s: float, joules: float | None) -> None: ...
    def on_finished(self, reason: str, usage: Usage) -> None: ...
    def on_queue(self, waiting: int, running: int) -> None: ...
    def on_phase(self, kind: str) -> None: ...


Sink = Callable[[object], None]


@dataclass
class _Live:
    req: SeqRequest
    sink: Sink
    detok: IncrementalDecoder
    stops: StopMatcher
    t_submit: float
    t_first: float | None = None
    t_last: float | None = None
    n_out: int = 0
    joules: float = 0.0
    done: bool = False


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, *, max_queue: int = 64,
                 listener: PhaseListener | None = None, meter: object | None = None,
                 metrics: EngineMetrics | None = None, on_tick: Callable[[], None] | None = None,
                 scheduler: Scheduler | None = None) -> None:
        self.executor, self.tokenizer = executor, tokenizer
        self.max_queue = max_queue
        # The scheduler keeps no bound of its own: the engine counts inbox + waiting atomically.
        self.scheduler = scheduler or Scheduler(executor.max_batch, executor.max_seq, tokenizer.eos_ids,
                                                max_queue=1 << 30)
        self.listener = listener or NullListener()
        self.meter = meter  # agent.board.EnergyMeter or None
        self.metrics = metrics
        self.on_tick = on_tick
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Requests submitted and not finished. The bound is the cache slots plus max_queue, so a
        # request that would get a free slot at once is never refused.
        self._inflight = 0
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        self._phase = "idle"
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.steps = 0

    # -- the API side (any thread) -------------------------------------------------------------
    @property
    def max_seq(self) -> int:
        return self.executor.max_seq

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def queue_depth(self) -> int:
        return max(0, self._inflight - self.scheduler.num_running)

    @property
    def in_flight(self) -> int:
        return self._inflight

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *,
               priority: str = "interactive", req_id: str | None = None) -> str:
        """Queue a request; raises QueueFull (retry later), RequestRejected (never runnable) or
        EngineStopped. Results go to `sink` (called on the engine thread)."""
        if priority not in PRIORITIES:
            raise RequestRejected(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        if not prompt_ids:
            raise RequestRejected("the prompt is empty: give at least one token of text")
        if len(prompt_ids) >= self.max_seq:
            raise RequestRejected(f"the prompt is {len(prompt_ids)} tokens but the context holds "
                                  f"{self.max_seq}; shorten it")
        rid = req_id or next_request_id()
        req = SeqRequest(rid, tuple(prompt_ids), params.max_tokens, PRIORITIES[priority],
                         params.ignore_eos, params)
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the service is shutting down")
            if self._inflight >= self.max_queue + self.executor.max_batch:
                raise QueueFull(self._inflight - self.executor.max_batch, retry_after_s=1)
            self._inflight += 1
        self._inbox.put(("submit", (req, sink, time.monotonic())))
        self._wake.set()
        return rid

    def cancel(self, req_id: str) -> None:
        self._inbox.put(("cancel", req_id))
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

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
                plan = self.scheduler.schedule()
                if self.metrics:
                    self.metrics.on_queue(self.queue_depth, self.scheduler.num_running)
                if plan is None:
                    self._set_phase(PhaseEvent("idle", time.monotonic()))
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._step(plan)
        finally:
            self._drain_inbox()
            for rid in list(self._live):
                self._finish(rid, "cancelled")
            self._set_phase(PhaseEvent("idle", time.monotonic()))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                req, sink, t = arg  # type: ignore[misc]
                try:
                    self.scheduler.add(req)
                except (RequestRejected, QueueFull) as exc:  # checked at submit; kept for safety
                    with self._lock:
                        self._inflight -= 1
                    self._send(sink, Finished("error", Usage(len(req.prompt_ids), 0, None, None, None, 0.0),
                                              str(exc)))
                    continue
                params: SamplingParams = req.sampling
                self._live[req.req_id] = _Live(req, sink, IncrementalDecoder(self.tokenizer),
                                               StopMatcher(params.stop), t)
            elif kind == "cancel":
                rid = str(arg)
                where = self.scheduler.abort(rid)
                if rid in self._live:
                    log.info("request %s cancelled (%s)", rid, where or "finished")
                    self._finish(rid, "cancelled")

    def _set_phase(self, event: PhaseEvent) -> None:
        # prefill / decode are announced every step (n_tokens, context and batch change);
        # idle once, on the transition.
        if event.kind == "idle" and self._phase == "idle":
            return
        self._phase = event.kind
        try:
            self.listener.on_phase(event)
        except Exception:  # a listener bug must not stop serving; log it with its traceback
            log.exception("phase listener failed on %s", event)
        if self.metrics:
            self.metrics.on_phase(event.kind)

    def _step(self, plan: StepPlan) -> None:
        now = time.monotonic()
        if plan.kind == "prefill":
            self._set_phase(PhaseEvent("prefill", now, n_tokens=plan.n_tokens, batch=len(plan.chunks)))
        else:
            self._set_phase(PhaseEvent("decode", now, context=plan.context, batch=len(plan.chunks)))
        try:
            out = self.executor.execute(plan)
        except Exception as exc:  # noqa: BLE001 - the runner failed: fail these requests, keep serving
            log.exception("step failed (%s of %d rows)", plan.kind, len(plan.chunks))
            for c in plan.chunks:
                self.scheduler.abort(c.req_id)
                self._finish(c.req_id, "error", f"the model runner failed: {type(exc).__name__}")
            return
        self.steps += 1
        joules = self.meter.step_joules(out.elapsed_s) if self.meter is not None else None
        if joules is not None and plan.n_tokens:
            for c in plan.chunks:
                live = self._live.get(c.req_id)
                if live:
                    live.joules += joules * len(c.token_ids) / plan.n_tokens
        if self.metrics:
            self.metrics.on_step(plan, out.elapsed_s, joules)
        for ev in self.scheduler.update(plan, out):
            self._on_token(ev)

    def _on_token(self, ev: TokenEvent) -> None:
        live = self._live.get(ev.req_id)
        if live is None:
            return
        now = time.monotonic()
        hit = False
        if ev.token is not None:
            live.n_out += 1
            if live.t_first is None:
                live.t_first = now
                if self.metrics:
                    self.metrics.on_first_token(now - live.t_submit)
            elif self.metrics and live.t_last is not None:
                self.metrics.on_token(now - live.t_last)
            live.t_last = now
            text, hit = live.stops.feed(live.detok.push(ev.token))
            if text:
                self._send(live.sink, Delta(text))
        if hit:
            self.scheduler.finish(ev.req_id)
            self._finish(ev.req_id, "stop")
        elif ev.finish_reason:
            tail, _ = live.stops.feed(live.detok.flush())
            tail += live.stops.flush()
            if tail:
                self._send(live.sink, Delta(tail))
            self._finish(ev.req_id, ev.finish_reason)

    def _finish(self, rid: str, reason: str, message: str = "") -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        with self._lock:
            self._inflight -= 1
        end = time.monotonic()
        ttft = live.t_first - live.t_submit if live.t_first else None
        tok_s = (live.n_out - 1) / (live.t_last - live.t_first) \
            if live.t_first and live.t_last and live.n_out > 1 and live.t_last > live.t_first else None
        energy = live.joules if self.meter is not None and self.meter.available else None
        usage = Usage(len(live.req.prompt_ids), live.n_out, energy, ttft, tok_s, end - live.t_submit)
        if self.metrics:
            self.metrics.on_finished(reason, usage)
        self._send(live.sink, Finished(reason, usage, message))

    @staticmethod
    def _send(sink: Sink, event: object) -> None:
        try:
            sink(event)
        except RuntimeError:  # the consumer's event loop is gone (client or server shut down)
            pass
