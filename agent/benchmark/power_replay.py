"""The energy benchmark driven by the service's own scheduler: each policy of ``power.bench.energy`` replays
the trace through :class:`agent.engine.scheduler.Scheduler` (admission, chunked prefill grouped by
length bucket, prefill-first with decode starvation guard, continuous batching), with an executor
whose step times come from the cost model on the twin, in virtual time (power.bench.run.PolicyRun).

So the benchmark exercises the scheduling users run. ``power`` never imports ``agent``: the policy,
twin and accounting parts stay in power.bench; this module is the engine side. The CLI
(``orin-agent bench power``) calls :func:`run_power_bench`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.engine.scheduler import Scheduler
from agent.engine.types import INTERACTIVE, SamplingParams, SeqRequest, StepOutput, StepPlan
from power.bench.energy import BenchConfig, BoardRun, PolicyResult, run_bench, run_boards
from power.bench.run import PolicyRun, Tally
from power.policy.phase import PhaseEvent
from power.bench.traces import Request

TOKEN = 1                   # the token every sampled row returns (never EOS: requests run to max_tokens)
MAX_SEQ = 8192              # context of the replayed model (Llama-3-8B: 8192)


@dataclass
class _Live:
    req: Request
    produced: int = 0
    first_s: float | None = None


def _phase(plan: StepPlan) -> tuple[PhaseEvent, int, int, int]:
    """The phase event a plan makes, and (size, batch, context) of its step for the cost model."""
    rows = len(plan.chunks)
    if plan.kind == "prefill":
        tokens = sum(len(c.token_ids) for c in plan.chunks)
        context = max(c.start_pos for c in plan.chunks)
        return PhaseEvent("prefill", n_tokens=tokens, context=plan.context, batch=rows), tokens, rows, context
    ctx = [c.start_pos + 1 for c in plan.chunks]
    return PhaseEvent("decode", context=max(ctx), batch=rows), sum(ctx) // rows, rows, 0


def scheduler_driver(run: PolicyRun, trace: tuple[Request, ...], cfg: BenchConfig) -> Tally:
    """Replay ``trace`` through a Scheduler of ``cfg.max_batch`` rows on ``run``."""
    sched = Scheduler(cfg.max_batch, MAX_SEQ, frozenset(), max_queue=max(64, len(trace)))
    pending = list(trace)
    live: dict[str, _Live] = {}
    tally = Tally()
    run.event(PhaseEvent("idle"))
    n = 0
    while pending or sched.has_work():
        while pending and pending[0].arrival_s <= run.t + 1e-9:
            r = pending.pop(0)
            rid = f"r{n}"
            n += 1
            live[rid] = _Live(r)
            sched.add(SeqRequest(rid, (TOKEN,) * min(r.prompt, MAX_SEQ - r.output - 1),
                                 SamplingParams(max_tokens=r.output, ignore_eos=True), INTERACTIVE))
        sched.row_cap = run.max_rows(cfg.max_batch)     # the budget's admission limit, None without one
        plan = sched.schedule()
        if plan is None:
            run.event(PhaseEvent("idle"))
            if pending:
                run.idle_until(pending[0].arrival_s)
            continue
        phase, size, rows, context = _phase(plan)
        run.event(phase)
        seconds = run.step(plan.kind, size, rows, context)
        events = sched.update(plan, StepOutput({c.req_id: TOKEN for c in plan.chunks if c.sample}, seconds))
        for ev in events:
            s = live[ev.req_id]
            if ev.token is not None:
                s.produced += 1
                tally.tokens += 1
                if s.first_s is None:
                    s.first_s = run.t
                    tally.ttft_s.append(run.t - s.req.arrival_s)
            if ev.finish_reason is not None:
                if s.produced > 1 and s.first_s is not None:
                    tally.tpot_s.append((run.t - s.first_s) / (s.produced - 1))
                del live[ev.req_id]
    return tally


def run_power_bench(cfg: BenchConfig) -> list[PolicyResult]:
    """``power.bench.energy.run_bench`` with the service's scheduler as the engine."""
    return run_bench(cfg, scheduler_driver)


def run_power_boards(cfg: BenchConfig) -> list[BoardRun]:
    """``power.bench.energy.run_boards`` (the exact model and ``cfg.boards`` sampled boards) with the service's
    scheduler as the engine."""
    return run_boards(cfg, scheduler_driver)


def run_power_budget_bench(cfg: BenchConfig, watts: float, window_s: float = 10.0,
                           rail: str | None = None) -> list[dict[str, Any]]:
    """``power.bench.budget.run_budget_bench`` (capped rows beside the nvpmodel mode) with the service's scheduler."""
    from power.bench.budget import run_budget_bench

    return run_budget_bench(cfg, watts, scheduler_driver, window_s=window_s, rail=rail)
