"""The scheduler over a paged KV-cache: the same policy as `agent.engine.scheduler.Scheduler` (classes,
chunked prefill, continuous batching), but memory is counted in KV blocks (kernels.paged.BlockManager),
not cache rows, and it deals only in block ids: each chunk carries its sequence's block table.

- Admission: a waiting request is admitted when the blocks its prompt fills are free (plus a one-block
  watermark, so that admitting it does not at once force a preemption); `max_batch` only caps how
  many sequences one step runs.
- Growth: before each step every decoding sequence gets the block its next token lands in.
- Preemption by recompute (vLLM's default, Kwon et al. SOSP 2023, section 4.5): when no block is
  free, the lowest-class, latest-admitted running sequence gives all its blocks back and waits at the
  head of the queue; readmitted, it prefills its prompt *and the output so far* and samples its next
  token there, so its output continues unchanged (same sampler state: the executor never saw it leave).
- Prefix sharing (`prefix_sharing=True`, the default): at admission a sequence takes the cached full
  blocks that match its first tokens (kernels.paged: hash of the block's tokens and of its prefix) and
  its prefill starts after them; each full block a step completes is registered for the next comer.
  Requests with a repetition penalty do not share (the executor's token history would miss the prefix).
Torch-free, like the base scheduler.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from agent.engine.scheduler import Scheduler, _Seq
from agent.engine.types import InvalidRequest, SeqChunk, SeqRequest, StepOutput, StepPlan, TokenEvent
from kernels.paged import BlockManager, block_hash

WATERMARK_BLOCKS = 1


@dataclass
class _PSeq(_Seq):
    target: int = 0  # tokens to prefill before decoding: the prompt, or prompt + output after a preemption
    blocks: list[int] = field(default_factory=list)
    order: int = 0  # admission order (preemption picks the latest)
    hashes: list[int] = field(default_factory=list)  # prefix hashes of blocks[:len(hashes)] (full, registered)

    @property
    def prompt_left(self) -> int:
        return max(0, self.target - self.computed)

    def fed(self) -> tuple[int, ...]:
        return self.req.prompt_ids + tuple(self.output)


class PagedScheduler(Scheduler):
    def __init__(self, max_batch: int, max_seq: int, num_blocks: int, block_size: int,
                 eos_ids: frozenset[int] = frozenset(), prefix_sharing: bool = True, **kwargs: int) -> None:
        super().__init__(max_batch, max_seq, eos_ids, **kwargs)
        self.prefix_sharing = prefix_sharing
        self.shared_tokens = 0  # prompt tokens whose prefill was skipped (their blocks were cached)
        self.blocks = BlockManager(num_blocks, block_size)
        self.preempted: deque[_PSeq] = deque()
        self.num_preemptions = 0
        self._admitted = 0

    @property
    def num_waiting(self) -> int:
        return super().num_waiting + len(self.preempted)

    def add(self, req: SeqRequest) -> None:
        need = self.blocks.blocks_for(len(req.prompt_ids) + 1)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(f"the prompt needs {need} KV blocks of {self.blocks.block_size} tokens; the "
                                 f"cache has {self.blocks.num_blocks}", "prompt")
        super().add(req)

    def abort(self, req_id: str) -> Literal["waiting", "running"] | None:
        for s in self.preempted:
            if s.req.req_id == req_id:
                self.preempted.remove(s)
                self._released.append(req_id)  # it had started: the executor holds its sampler
                return "waiting"
        return super().abort(req_id)

    def _release(self, req_id: str) -> None:
        seq = self.running[req_id]
        assert isinstance(seq, _PSeq)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        super()._release(req_id)

    # -- memory ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Called first by `schedule()`: grow the decoding sequences, then admit (not in a step that
        had to preempt: what was just freed goes to the preempted sequence's turn, not a newcomer's)."""
        if not self._grow():
            self._admit_by_blocks()

    def _admit_by_blocks(self) -> None:
        while self.free_slots:
            if self.preempted:
                seq, req = self.preempted[0], None
            else:
                if self.row_cap is not None and len(self.running) >= self.row_cap:
                    return  # a power budget's admission limit (rows already running finish)
                req = next((q[0] for _, q in sorted(self.waiting.items()) if q), None)
                if req is None:
                    return
                seq = _PSeq(req, -1, target=len(req.prompt_ids))
            shared = self._cached_prefix(seq)
            need = self.blocks.blocks_for(seq.target) - len(shared)
            free = self.blocks.free_if_shared(shared)
            if need + WATERMARK_BLOCKS > free and self.running:
                return  # FIFO: nothing overtakes the head of the queue
            if need > free:
                return
            if req is None:
                self.preempted.popleft()
            else:
                self.waiting[req.priority].popleft()
            seq.slot = self.free_slots.pop(0)
            seq.blocks = [self.blocks.share(h) for h in shared] + self.blocks.allocate(need)
            seq.hashes = list(shared)
            seq.computed = len(shared) * self.blocks.block_size  # prefill skips the shared blocks
            self.shared_tokens += seq.computed
            self._admitted += 1
            seq.order = self._admitted
            self.running[seq.req.req_id] = seq

    def _cached_prefix(self, seq: _PSeq) -> list[int]:
        """Hashes of the cached full blocks the sequence starts with, never the block holding its last
        token to prefill (that one is computed: it gives the logits to sample from)."""
        if not self.prefix_sharing or seq.req.sampling.repetition_penalty != 1.0:
            return []
        bs, toks = self.blocks.block_size, seq.fed()
        out: list[int] = []
        for i in range((seq.target - 1) // bs):
            h = block_hash(out[-1] if out else None, toks[i * bs:(i + 1) * bs])
            if self.blocks.peek(h) is None:
                break
            out.append(h)
        return out

    def update(self, plan: StepPlan, output: StepOutput) -> list[TokenEvent]:
        events = super().update(plan, output)
        if self.prefix_sharing:
            for c in plan.chunks:
                seq = self.running.get(c.req_id)
                if isinstance(seq, _PSeq):
                    self._register_full_blocks(seq)
        return events

    def _register_full_blocks(self, seq: _PSeq) -> None:
        bs, toks = self.blocks.block_size, seq.fed()
        for i in range(len(seq.hashes), seq.computed // bs):
            h = block_hash(seq.hashes[-1] if seq.hashes else None, toks[i * bs:(i + 1) * bs])
            self.blocks.register(seq.blocks[i], h)
            seq.hashes.append(h)

    def _preempt(self) -> _PSeq:
        victim = max(self.running.values(), key=lambda s: (s.req.priority, s.order))  # type: ignore[attr-defined]
        assert isinstance(victim, _PSeq)
        del self.running[victim.req.req_id]
        self.blocks.free(victim.blocks)
        self.free_slots.append(victim.slot)
        self.free_slots.sort()
        victim.blocks, victim.computed, victim.target, victim.hashes = [], 0, len(victim.fed()), []
        self.preempted.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _grow(self) -> bool:
        """Give every decoding sequence the block its next token needs, preempting when none is free.
        True if something was preempted."""
        preempted = False
        for seq in sorted(self.running.values(), key=lambda s: (s.req.priority, s.order)):
            assert isinstance(seq, _PSeq)
            if seq.prompt_left > 0 or seq.req.req_id not in self.running:
                continue
            need = self.blocks.blocks_for(seq.computed + 1) - len(seq.blocks)
            while need > 0 and seq.req.req_id in self.running:
                if self.blocks.can_allocate(need):
                    seq.blocks += self.blocks.allocate(need)
                    need = 0
                else:
                    preempted = True
                    self._preempt()
        return preempted

    # -- chunks carry block tables ---------------------------------------------------------------
    def _chunk(self, seq: _Seq, tokens: tuple[int, ...], sample: bool) -> SeqChunk:
        assert isinstance(seq, _PSeq)
        return SeqChunk(seq.req.req_id, seq.slot, tokens, seq.computed, sample,
                        None if seq.started else seq.req.sampling, blocks=tuple(seq.blocks))

    def _prefill_plan(self, cands: list[_Seq]) -> StepPlan:
        group, t = self._prefill_group(cands)
        chunks = []
        for s in group:
            assert isinstance(s, _PSeq)
            toks = s.fed()[s.computed:s.computed + t]
            chunks.append(self._chunk(s, toks, sample=s.computed + t == s.target))
        return StepPlan("prefill", tuple(chunks), self._released_now())
