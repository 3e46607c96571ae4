"""From sampled tokens to what a request's caller sees: incremental detokenisation into whole
characters, stop strings (with the held-back tail that might start one), each request's usage
(TTFT, decode rate, duration) and its share of each step's energy.

`OutputProcessor` keeps one `_Live` per running request; `EngineCore` feeds it the scheduler's token
events and step energies and hands its `RequestOutput`s to the caller. No torch here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from agent.engine.types import (Delta, EngineMetrics, Finished, RequestOutput, SeqRequest, StepPlan, TokenEvent,
                                TokenLogprob, Usage)
from partition.tokenizer import IncrementalDecoder, Tokenizer


class StopMatcher:
    """Finds stop strings in streamed text and holds back a tail that might be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += delta
        if not self.stops:
            return self._emit(len(self.text)), False
        window = max(0, self.emitted - max(len(s) for s in self.stops))
        hits = [i for i in (self.text.find(s, window) for s in self.stops) if i >= 0]
        if hits:
            return self._emit(min(hits)), True
        hold = 0
        for s in self.stops:  # longest suffix of the text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._emit(len(self.text) - hold), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


@dataclass
class _Live:
    req: SeqRequest
    detok: IncrementalDecoder
    stops: StopMatcher
    t_submit: float
    t_first: float | None = None
    t_last: float | None = None
    token_ids: list[int] = field(default_factory=list)
    joules: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # tokens whose text is not yet emitted

    def delta(self, text: str) -> Delta:
        d = Delta(text, tuple(self.logprobs))
        self.logprobs.clear()
        return d


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer, self.metrics, self.clock = tokenizer, metrics, clock
        self.live: dict[str, _Live] = {}

    def add(self, req: SeqRequest, t_submit: float) -> None:
        self.live[req.req_id] = _Live(req, IncrementalDecoder(self.tokenizer), StopMatcher(req.sampling.stop),
                                      t_submit)

    def add_energy(self, plan: StepPlan, joules: float) -> None:
        """A step's joules, shared among its requests in proportion to their tokens in it."""
        if not plan.n_tokens:
            return
        for c in plan.chunks:
            live = self.live.get(c.req_id)
            if live:
                live.joules += joules * len(c.token_ids) / plan.n_tokens

    def process(self, ev: TokenEvent, energy_available: bool) -> tuple[list[RequestOutput], bool]:
        """One token event -> the request's outputs, and whether a stop string ended it (the caller
        then tells the scheduler, which does not know about text)."""
        live = self.live.get(ev.req_id)
        if live is None:
            return [], False
        outs: list[RequestOutput] = []
        now = self.clock()
        hit = False
        if ev.token is not None:
            live.token_ids.append(ev.token)
            if live.t_first is None:
                live.t_first = now
                if self.metrics:
                    self.metrics.on_first_token(now - live.t_submit)
            elif self.metrics and live.t_last is not None:
                self.metrics.on_token(now - live.t_last)
            live.t_last = now
            if ev.logprob is not None:
                live.logprobs.append(ev.logprob)
            text, hit = live.stops.feed(live.detok.push(ev.token))
            if text:
                outs.append(RequestOutput(ev.req_id, live.delta(text)))
        if hit:  # what was held back is the stop string itself: nothing more to emit
            outs.extend(self.finish(ev.req_id, "stop", energy_available))
        elif ev.finish_reason:
            tail, _ = live.stops.feed(live.detok.flush())
            tail += live.stops.flush()
            if tail or live.logprobs:  # the last tokens' logprobs, even where their text is empty
                outs.append(RequestOutput(ev.req_id, live.delta(tail)))
            outs.extend(self.finish(ev.req_id, ev.finish_reason, energy_available))
        return outs, hit

    def finish(self, rid: str, reason: str, energy_available: bool, message: str = "") -> list[RequestOutput]:
        """End a request: its `Finished` (with usage), or nothing when it already ended."""
        live = self.live.pop(rid, None)
        if live is None:
            return []
        end = self.clock()
        n_out = len(live.token_ids)
        ttft = live.t_first - live.t_submit if live.t_first else None
        tok_s = (n_out - 1) / (live.t_last - live.t_first) \
            if live.t_first and live.t_last and n_out > 1 and live.t_last > live.t_first else None
        usage = Usage(len(live.req.prompt_ids), n_out, live.joules if energy_available else None, ttft, tok_s,
                      end - live.t_submit)
        if self.metrics:
            self.metrics.on_finished(reason, usage)
        return [RequestOutput(rid, Finished(reason, usage, message, tuple(live.token_ids)))]
