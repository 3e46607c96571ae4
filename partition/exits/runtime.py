"""Exits over a chain of slice runners cut at the exit layers, one request row at a time.

A row whose token leaves after layer l has run only the runners up to l. Nothing is copied into the
layers it skipped: the hidden states entering each skipped runner wait in that runner's backlog, and
the next step that goes deeper runs the runner over its backlog and the new token in one batch
(FREE's batched catch-up, EE-LLM's recomputation). Every layer's KV-cache therefore ends exactly as
full-depth decoding would have left it; a skipped token costs deep compute later, not accuracy later.

Invariant per row and runner j: the cache of runner j holds positions [0, filled[j]); backlog[j]
holds the hidden states entering runner j for positions [filled[j], filled[j-1]) (shape (1, T, D)).
A speculative round drafts with `step(stop_at=e)` several times, verifies with `finish()` (every
position's logits from the deep runners in one pass), then `rollback()`s the rejected tail: caches
are written by position, so forgetting a position is moving `filled` back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

import numpy as np
import torch
from torch import Tensor

from partition.exits.heads import ExitHeads, ExitHeadsError
from partition.runners.chain import Chain, convert

Decide = Callable[[int, Tensor], bool]  # (exit layer, head logits (V,)) -> leave here?


@dataclass
class RowState:
    filled: list[int]  # per runner: cache positions written
    backlog: list[Tensor | None]  # per runner: hidden states (1, T, D) waiting to enter it
    deep_passes: int = 0  # runs of the last runner (what exits and speculation save)

    @property
    def pending(self) -> int:
        """Tokens some runner still owes its cache (the backlog an offload would send)."""
        return self.filled[0] - self.filled[-1]


@dataclass
class StepResult:
    logits: Tensor  # float32 (V,) or, from finish(), (T, V)
    layer: int  # the layer the logits were read after (n_layers: full depth)
    head_evals: int = 0  # exit heads computed on the way
    runner_calls: list[int] = field(default_factory=list)


class ExitChain:
    def __init__(self, chain: Chain, heads: ExitHeads, verify: bool = True) -> None:
        self.chain, self.heads = chain, heads
        self.n_layers = chain.runners[0].spec.n_layers_total
        ends = [r.spec.end for r in chain.runners]
        missing = [l for l in heads.layers if l not in ends]
        if missing:
            raise ExitHeadsError(f"exit layers {missing} are not slice boundaries of the chain "
                                 f"({', '.join(str(r.spec) for r in chain.runners)}); cut the slices there")
        # verification (finish) reads every position's logits from the last slice: a local torch runner.
        # Exits alone need only the last position's: with verify=False the last slice may be an edge server's.
        self.can_verify = chain.runners[-1].array_kind == "torch"
        if verify and not self.can_verify:
            raise ExitHeadsError("exits and speculation need the torch backend for the last slice "
                                 "(its every-position logits); use --backend torch")
        self.exit_after = {j: r.spec.end for j, r in enumerate(chain.runners) if r.spec.end in heads.layers}
        self.draft_runner = {r.spec.end: j for j, r in enumerate(chain.runners)}

    def new_row(self, filled: int = 0) -> RowState:
        n = len(self.chain.runners)
        return RowState([filled] * n, [None] * n)

    def _run(self, j: int, x: Tensor | np.ndarray, start: int, slot: int, all_logits: bool = False) -> Tensor:
        r = self.chain.runners[j]
        t = x.shape[1]
        positions = np.arange(start, start + t, dtype=np.int32)[None]  # (1, T)
        kwargs = {"all_logits": True} if all_logits else {}
        out = r.run(convert(x, r.array_kind), positions, [slot], **kwargs)
        return convert(out, "torch")

    @torch.inference_mode()
    def step(self, st: RowState, slot: int, token: int, pos: int, decide: Decide | None = None,
             stop_at: int | None = None, heads_at: Collection[int] | None = None) -> StepResult:
        """Feed `token` at `pos`; leave after the first exit layer where `decide` says so (or at
        `stop_at`, without computing its head: a draft's last token), else run to full depth.
        heads_at: the exit layers whose head is computed at all (None: every one)."""
        if st.filled[0] != pos:
            raise ValueError(f"row is at position {st.filled[0]}, asked to feed position {pos}")
        res = StepResult(torch.empty(0), self.n_layers)
        out = self._run(0, np.array([[token]], dtype=np.int32), pos, slot)
        st.filled[0] = pos + 1
        res.runner_calls.append(0)
        last = len(self.chain.runners) - 1
        for j in range(1, last + 1):
            prev = st.backlog[j]
            st.backlog[j] = out if prev is None else torch.cat((prev, out), dim=1)
            layer = self.exit_after.get(j - 1)
            if layer is not None and layer == stop_at:
                res.layer = layer
                return res
            if layer is not None and decide is not None and (heads_at is None or layer in heads_at):
                logits = self.heads(layer, out[0, -1]).float()
                res.head_evals += 1
                if decide(layer, logits):
                    res.logits, res.layer = logits, layer
                    return res
            out = self._run_backlog(st, j, slot)
            res.runner_calls.append(j)
        res.logits = out[0].float()
        return res

    def _run_backlog(self, st: RowState, j: int, slot: int, all_logits: bool = False) -> Tensor:
        x = st.backlog[j]
        assert x is not None  # the previous runner always adds to it
        out = self._run(j, x, st.filled[j], slot, all_logits=all_logits)
        st.filled[j] += x.shape[1]
        st.backlog[j] = None
        if j == len(self.chain.runners) - 1:
            st.deep_passes += 1
        return out

    @torch.inference_mode()
    def draft_logits(self, layer: int, st: RowState) -> Tensor:
        """The exit head's logits (V,) for the newest position waiting after `layer`."""
        x = st.backlog[self.draft_runner[layer] + 1]
        assert x is not None
        return self.heads(layer, x[0, -1]).float()

    @torch.inference_mode()
    def finish(self, st: RowState, slot: int) -> Tensor:
        """Run every backlog through the rest of the chain in one pass per runner: float32 logits
        (T, V) of the positions the last runner had not seen."""
        if not self.can_verify:
            raise ExitHeadsError("speculation verifies with every position's logits from the last slice, which "
                                 "needs a local torch runner there (not an edge server, not --backend ort)")
        out: Tensor | None = None
        for j in range(1, len(self.chain.runners)):
            if out is not None:
                prev = st.backlog[j]
                st.backlog[j] = out if prev is None else torch.cat((prev, out), dim=1)
            if st.backlog[j] is None:
                continue
            out = self._run_backlog(st, j, slot, all_logits=j == len(self.chain.runners) - 1)
        if out is None:
            raise ValueError("nothing to verify: every runner is up to date")
        return out[0].float()

    def rollback(self, st: RowState, upto: int) -> None:
        """Forget positions >= upto (rejected drafts): their cache slots get overwritten later."""
        for j in range(len(st.filled)):
            x = st.backlog[j]
            if x is not None:
                keep = upto - st.filled[j]
                st.backlog[j] = x[:, :keep] if keep > 0 else None
            st.filled[j] = min(st.filled[j], upto)
