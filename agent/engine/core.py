"""`EngineCore`: the one generation path. Both the service (through `agent.engine.loop`, a thread
around it) and `orin-agent generate` (stepping it directly) run every token through `step()`:

    plan = scheduler.schedule()            # which rows run (agent.engine.scheduler)
    listener.on_phase(prefill|decode|idle) # the power controller's seam (agent.phases)
    out  = executor.execute(plan)          # the model (agent.engine.executor)
    scheduler.update(plan, out)            # EOS, token budget -> token events
    -> output processor                    # text deltas, stop strings, usage, energy (agent.engine.output)

as vLLM v1's EngineCore.step() does. It owns no thread and no queue: the caller adds requests, calls
`step()` while `has_work()`, and routes the `RequestOutput`s it returns.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

from agent.engine.output import OutputProcessor
from agent.engine.scheduler import Scheduler
from agent.engine.types import (Delta, EnergyMeter, EngineMetrics, Executor, Finished, RequestOutput,
                                SamplingParams, SeqRequest, StepPlan, next_request_id)
from agent.phases import NullListener, PhaseListener
from partition.tokenizer import Tokenizer
from power.policy.phase import PhaseEvent

log = logging.getLogger("orin_agent.engine")


class EngineCore:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, *, listener: PhaseListener | None = None,
                 meter: EnergyMeter | None = None, metrics: EngineMetrics | None = None,
                 scheduler: Scheduler | None = None) -> None:
        self.executor, self.tokenizer = executor, tokenizer
        # No queue bound here: the caller (the loop) bounds what it submits.
        self.scheduler = scheduler or Scheduler(executor.max_batch, executor.max_seq, tokenizer.eos_ids,
                                                max_queue=1 << 30)
        self.listener: PhaseListener = listener or NullListener()
        self.meter, self.metrics = meter, metrics
        self.output = OutputProcessor(tokenizer, metrics)
        self.phase = "idle"
        self.steps = 0

    @property
    def max_seq(self) -> int:
        return self.executor.max_seq

    @property
    def energy_available(self) -> bool:
        return self.meter is not None and self.meter.available

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_request(self, req: SeqRequest, t_submit: float | None = None) -> None:
        """Queue a request; raises InvalidRequest (never runnable) or QueueFull."""
        self.scheduler.add(req)
        self.output.add(req, time.monotonic() if t_submit is None else t_submit)

    def abort(self, req_id: str, reason: str = "cancelled", message: str = "") -> list[RequestOutput]:
        """End a request wherever it is (its cache slot is free for the next step)."""
        where = self.scheduler.abort(req_id)
        outs = self.output.finish(req_id, reason, self.energy_available, message)
        if outs and reason == "cancelled":
            log.info("request %s cancelled (%s)", req_id, where or "finished")
        return outs

    def step(self) -> list[RequestOutput]:
        """Schedule -> phase event -> execute -> update: one step, and what it gave each request."""
        self.scheduler.row_cap = self._row_cap()
        plan = self.scheduler.schedule()
        now = time.monotonic()
        if plan is None:
            self.set_phase(PhaseEvent("idle", batch=0, t=now))
            return []
        if plan.kind == "prefill":
            self.set_phase(PhaseEvent("prefill", n_tokens=plan.n_tokens, context=plan.context, batch=len(plan.chunks),
                                      t=now))
        else:
            self.set_phase(PhaseEvent("decode", context=plan.context, batch=len(plan.chunks), t=now))
        try:
            out = self.executor.execute(plan)
        except Exception as exc:  # noqa: BLE001 - the runner failed: fail these requests, keep serving
            return self._fail(plan, exc)
        self.steps += 1
        joules = self.meter.step_joules(out.elapsed_s) if self.meter is not None else None
        if joules is not None:
            self.output.add_energy(plan, joules)
        if self.metrics:
            self.metrics.on_step(plan, out.elapsed_s, joules)
            if out.depth is not None:
                self.metrics.on_depth(out.depth)
        outputs: list[RequestOutput] = []
        for ev in self.scheduler.update(plan, out):
            outs, stopped = self.output.process(ev, self.energy_available)
            if stopped:  # a stop string: the scheduler only knows tokens
                self.scheduler.finish(ev.req_id)
            outputs += outs
        return outputs

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 req_id: str | None = None) -> Iterator[Delta | Finished]:
        """One request, stepped here until it finishes: its deltas, then its `Finished`. Other
        requests already added keep running in the same steps."""
        rid = req_id or next_request_id()
        self.add_request(SeqRequest(rid, tuple(prompt_ids), params))
        while self.has_work():
            for o in self.step():
                if o.req_id == rid:
                    yield o.event
                    if isinstance(o.event, Finished):
                        return
        raise RuntimeError(f"request {rid} left the scheduler without finishing")  # a bug, not bad input

    def _row_cap(self) -> int | None:
        """The rows the listener lets the next step run (a power budget's limit, through the same listener
        as the phase events); None: the executor's max_batch."""
        try:
            return self.listener.max_rows(self.executor.max_batch)
        except Exception:  # noqa: BLE001 - a listener bug must not stop serving; log it, admit as usual
            log.exception("phase listener failed on max_rows")
            return None

    def set_phase(self, event: PhaseEvent) -> None:
        """Tell the listener: prefill / decode every step (n_tokens, context and batch change), idle
        once, on the transition."""
        if event.kind == "idle" and self.phase == "idle":
            return
        self.phase = event.kind
        try:
            self.listener.on_phase(event)
        except Exception:  # noqa: BLE001 - a listener bug must not stop serving; log it with its traceback
            log.exception("phase listener failed on %s", event)
        if self.metrics:
            self.metrics.on_phase(event.kind)

    def _fail(self, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        log.exception("step failed (%s of %d rows)", plan.kind, len(plan.chunks))
        outs: list[RequestOutput] = []
        # an OSError (e.g. partition.offload's EdgeError: the edge server did not answer within its
        # deadline) says what went wrong in one line, with no internals: the client gets that line, and
        # the request ends "unavailable" (the API answers 503 + Retry-After: a later try may succeed)
        transient = isinstance(exc, OSError)
        why = f"{type(exc).__name__}: {str(exc)[:300]}" if transient else type(exc).__name__
        for c in plan.chunks:
            outs += self.abort(c.req_id, "unavailable" if transient else "error", f"the model runner failed: {why}")
        return outs
