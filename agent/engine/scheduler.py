"""The scheduler: which sequences run in the next step, and what their results mean (EOS, the token
budget).

One step is the whole contract with the model runner (vLLM v1's shape): `schedule()` returns a
`StepPlan`, the runner executes it and returns a `StepOutput`, `update(plan, output)` turns that into
per-request token events. Only plain frozen dataclasses cross; the scheduler deals in cache slots
(rows of the runner's preallocated KV-cache) and token ids, never tensors, and never imports torch.

Policy, in order:
- Admission: a waiting request takes a free cache slot, interactive before background, FIFO within a
  class, while fewer than `row_cap` rows run (a power budget may lower it; rows already running finish). The wait queue is bounded (`QueueFull`, which the API turns into 429 + Retry-After).
- Every row of a step has the same number of tokens T (the runner's contract), so a step is either
  a prefill or a decode. Prefill rows are grouped by length bucket (powers of two of the tokens still
  to prefill): a group advances by the shortest remainder in it (capped by `max_prefill_chunk`), and
  longer prompts continue in a later chunk at their next position. That is chunked prefill: padding
  is never written into the cache, and a long prompt cannot hold the loop for more than one chunk.
- Prefill first (it gives the next request its first token; TTFT matters most), unless the waiting
  prefill is of a lower class than a running decode; a decode-starved prefill still runs every
  `starve_steps` steps.
- Decode: every sequence that has its prompt in the cache, batched (continuous batching: sequences
  join and leave between steps).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from agent.engine.types import (BACKGROUND, INTERACTIVE, QueueFull, SeqChunk, SeqRequest, StepOutput, StepPlan,
                                TokenEvent, TokenLogprob, check_prompt)


@dataclass
class _Seq:
    req: SeqRequest
    slot: int
    computed: int = 0  # prompt + output tokens already in the cache
    output: list[int] = field(default_factory=list)
    started: bool = False  # first chunk sent (the runner knows this request)

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.req.prompt_ids) - self.computed)


def length_bucket(n: int) -> int:
    """Prefill rows in one step come from one bucket: 1, 2, 3-4, 5-8, 9-16, ..."""
    return 0 if n <= 1 else math.ceil(math.log2(n))


class Scheduler:
    def __init__(self, max_batch: int, max_seq: int, eos_ids: frozenset[int] = frozenset(), *,
                 max_queue: int = 64, max_prefill_chunk: int = 512, max_prefill_tokens: int = 2048,
                 starve_steps: int = 8, retry_after_s: int = 1) -> None:
        if max_batch < 1 or max_seq < 2 or max_queue < 0:
            raise ValueError("max_batch must be >= 1, max_seq >= 2 and max_queue >= 0")
        self.max_batch, self.max_seq, self.eos_ids = max_batch, max_seq, frozenset(eos_ids)
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.max_prefill_chunk, self.max_prefill_tokens = max_prefill_chunk, max_prefill_tokens
        self.starve_steps = starve_steps
        self.waiting: dict[int, deque[SeqRequest]] = {INTERACTIVE: deque(), BACKGROUND: deque()}
        self.running: dict[str, _Seq] = {}
        self.free_slots: list[int] = list(range(max_batch))
        self._released: list[str] = []
        self._skipped_prefill = 0
        self.row_cap: int | None = None  # admit only while fewer rows run (a power budget's limit); None: max_batch

    # -- requests in and out -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, req: SeqRequest) -> None:
        check_prompt(req.prompt_ids, self.max_seq)
        if self.num_waiting >= self.max_queue:
            raise QueueFull(self.num_waiting, self.retry_after_s)
        self.waiting[req.priority].append(req)

    def abort(self, req_id: str) -> Literal["waiting", "running"] | None:
        """Drop a request wherever it is; its cache slot is free for the next step."""
        for q in self.waiting.values():
            for r in q:
                if r.req_id == req_id:
                    q.remove(r)
                    return "waiting"
        if req_id in self.running:
            self._release(req_id)
            return "running"
        return None

    def finish(self, req_id: str) -> None:
        """The engine ended a request for a reason of its own (a stop string)."""
        if req_id in self.running:
            self._release(req_id)

    def _release(self, req_id: str) -> None:
        seq = self.running.pop(req_id)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        if seq.started:
            self._released.append(req_id)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self._admit()
        prefill = [s for s in self.running.values() if s.prompt_left > 0]
        decode = [s for s in self.running.values() if s.prompt_left == 0]
        if not prefill and not decode:
            return None
        do_prefill = bool(prefill)
        if prefill and decode:
            best_pf = min(s.req.priority for s in prefill)
            best_dec = min(s.req.priority for s in decode)
            do_prefill = best_pf <= best_dec or self._skipped_prefill >= self.starve_steps
            self._skipped_prefill = 0 if do_prefill else self._skipped_prefill + 1
        plan = self._prefill_plan(prefill) if do_prefill else self._decode_plan(decode)
        for c in plan.chunks:
            self.running[c.req_id].started = True
        return plan

    def _admit(self) -> None:
        for prio in sorted(self.waiting):
            q = self.waiting[prio]
            while q and self.free_slots and (self.row_cap is None or len(self.running) < self.row_cap):
                req = q.popleft()
                self.running[req.req_id] = _Seq(req, self.free_slots.pop(0))

    def _released_now(self) -> tuple[str, ...]:
        out, self._released = tuple(self._released), []
        return out

    def _chunk(self, seq: _Seq, tokens: tuple[int, ...], sample: bool) -> SeqChunk:
        return SeqChunk(seq.req.req_id, seq.slot, tokens, seq.computed, sample,
                        None if seq.started else seq.req.sampling)

    def _prefill_group(self, cands: list[_Seq]) -> tuple[list[_Seq], int]:
        """The rows prefilled together and their chunk length: the first in line (class, then arrival
        via the running dict's insertion order) picks the length bucket."""
        order = sorted(cands, key=lambda s: s.req.priority)
        head = order[0]
        bucket = length_bucket(head.prompt_left)
        group = [s for s in order if s.req.priority == head.req.priority and length_bucket(s.prompt_left) == bucket]
        t = min(min(s.prompt_left for s in group), self.max_prefill_chunk)
        return group[:max(1, self.max_prefill_tokens // t)], t

    def _prefill_plan(self, cands: list[_Seq]) -> StepPlan:
        group, t = self._prefill_group(cands)
        chunks = []
        for s in group:
            toks = s.req.prompt_ids[s.computed:s.computed + t]
            chunks.append(self._chunk(s, toks, sample=s.computed + t == len(s.req.prompt_ids)))
        return StepPlan("prefill", tuple(chunks), self._released_now())

    def _decode_plan(self, seqs: list[_Seq]) -> StepPlan:
        chunks = tuple(self._chunk(s, (s.output[-1],), sample=True) for s in seqs)
        return StepPlan("decode", chunks, self._released_now())

    def update(self, plan: StepPlan, output: StepOutput) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for c in plan.chunks:
            seq = self.running.get(c.req_id)
            if seq is None:  # aborted while the step ran
                continue
            seq.computed += len(c.token_ids)
            if not c.sample:
                continue
            more = output.more.get(c.req_id, ())
            lps = output.logprobs.get(c.req_id, ())
            for i, token in enumerate((output.tokens[c.req_id], *more)):
                seq.computed += 1 if i else 0  # a speculative step fed every emitted token but the last
                if self._emit(seq, token, events, lps[i] if i < len(lps) else None):
                    break
        return events

    def _emit(self, seq: _Seq, token: int, events: list[TokenEvent], logprob: TokenLogprob | None = None) -> bool:
        """One sampled token of a row: its event; True when it ended the request."""
        rid = seq.req.req_id
        if token in self.eos_ids and not seq.req.sampling.ignore_eos:
            events.append(TokenEvent(rid, None, "stop"))
            self._release(rid)
            return True
        seq.output.append(token)
        # At most max_seq - prompt tokens of output: the cache holds no more.
        budget = min(seq.req.sampling.max_tokens, self.max_seq - len(seq.req.prompt_ids))
        full = len(seq.output) >= budget
        events.append(TokenEvent(rid, token, "length" if full else None, logprob))
        if full:
            self._release(rid)
        return full

