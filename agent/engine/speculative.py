"""The executor for early exits and lossless self-speculative decoding, per request:

- `speculate=k`: the layers up to a draft exit plus its head propose k tokens one at a time; the
  deep layers check all of them in one pass over the backlog; the longest prefix the full model
  agrees with is kept, plus the full model's own next token (LayerSkip, arXiv 2404.16710). Greedy
  output is the full model's token for token; when sampling, the standard acceptance rule (accept
  d with probability min(1, p(d)/q(d)), else draw from max(0, p - q)) keeps the distribution exact
  (Leviathan et al., arXiv 2211.17192).
- `max_disagreement=x`: a token leaves at the first exit whose head's top-1 probability reaches the
  calibrated threshold for target x (`orin-agent calibrate`); the layers it skipped catch up from
  the backlog on the next deeper step (partition.exits.runtime).

Rows in either mode run one at a time (their depths differ); other rows, and every prefill, run
batched through the chain as in `ChainExecutor`. Statistics accumulate in `stats`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agent.engine.executor import ChainExecutor
from agent.engine.sampling import Sampler, sample, warp
from agent.engine.types import DepthStats, SeqChunk, StepOutput, StepPlan, TokenLogprob
from partition.config import ModelConfig
from partition.exits.heads import Calibration, ExitHeads, pick_calibration, read_record
from partition.exits.runtime import ExitChain, RowState
from partition.runners.chain import Chain


@dataclass
class ExitStats:
    """Counts over every exit-mode or speculative token since the executor started (or reset)."""

    n_layers: int
    tokens: int = 0
    exits: dict[int, int] = field(default_factory=dict)  # layer the token left after -> tokens
    deep_passes: int = 0  # runs of the last slice
    rounds: int = 0  # speculative rounds
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # accepted drafts in a round -> rounds
    targets: dict[str, str] = field(default_factory=dict)  # request -> calibration used

    def add(self, step: DepthStats) -> None:
        for layer, n in step.exits:
            self.exits[layer] = self.exits.get(layer, 0) + n
        self.tokens += step.tokens
        self.deep_passes += step.deep_passes
        self.rounds += len(step.accepted)
        self.drafted += step.drafted
        self.accepted += sum(step.accepted)
        for a in step.accepted:
            self.accepted_lengths[a] = self.accepted_lengths.get(a, 0) + 1

    def as_dict(self) -> dict[str, object]:
        n = max(1, self.tokens)
        return {
            "decode_tokens": self.tokens,
            "exits_per_layer": {str(l): c for l, c in sorted(self.exits.items())},
            "exit_rate_per_layer": {str(l): round(c / n, 4) for l, c in sorted(self.exits.items())},
            "full_depth_tokens": self.exits.get(self.n_layers, 0),
            "deep_passes": self.deep_passes,
            "deep_passes_per_token": round(self.deep_passes / n, 4),
            "speculative_rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_accepted_draft_length": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "accepted_draft_length_rounds": {str(a): c for a, c in sorted(self.accepted_lengths.items())},
            "calibration": dict(self.targets),
        }


class _StepDepth:
    """One step's `DepthStats`, added to as the rows run."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.exits: dict[int, int] = {}
        self.deep_passes = self.drafted = 0
        self.accepted: list[int] = []

    def token(self, layer: int, n: int = 1) -> None:
        self.exits[layer] = self.exits.get(layer, 0) + n

    def freeze(self) -> DepthStats | None:
        if not self.exits:
            return None
        return DepthStats(self.n_layers, tuple(sorted(self.exits.items())), self.deep_passes, self.drafted,
                          tuple(self.accepted))


def step_costs(cfg: ModelConfig) -> tuple[float, float, float]:
    """(one layer, the LM head, one exit translator) as fractions of a full-depth decode step, by
    weights read (decode streams every weight once per step: memory-bound on a GPU or an Orin)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    layer = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + 3 * d * cfg.intermediate_size
    head = cfg.vocab_size * d
    total = cfg.n_layers * layer + head
    return layer / total, head / total, d * d / total


def speedup_estimate(agreement: float, k: int, draft_layer: int, cfg: ModelConfig) -> float:
    """Expected tokens per round, (1 - a^(k+1)) / (1 - a), over the round's cost in full-depth
    steps: k+1 shallow passes, k draft heads, and one deep pass (over k+1 tokens: about the cost of
    one, decode being bound by reading the weights) with the final head."""
    layer, head, translator = step_costs(cfg)
    a = min(agreement, 0.999)
    tokens = (1 - a ** (k + 1)) / (1 - a)
    cost = (k + 1) * draft_layer * layer + k * (head + translator) + (cfg.n_layers - draft_layer) * layer + head
    return tokens / cost


def paying_layers(cal: Calibration, cfg: ModelConfig) -> frozenset[int]:
    """The exit layers whose head is worth computing for this calibration: a finite threshold, and,
    where the calibration measured held-out exit rates, expected savings over the head's cost in
    weights read (`step_costs`): rate(l) * (N - l) layers > P(a token reaches l) * (LM head +
    translator). The skipped layers of an exited token still run later (the backlog), batched, so
    they are counted as saved weight reads, not saved compute. Leaving a layer out can only lower
    the disagreement: each layer's threshold is certified on its own (Bonferroni split)."""
    layer, head, translator = step_costs(cfg)
    n, reach, out = cfg.n_layers, 1.0, set()
    for l in sorted(cal.thresholds):
        if cal.thresholds[l] == float("inf"):
            continue
        r = cal.exit_rates.get(l)
        if r is None or r * (n - l) * layer > reach * (head + translator):
            out.add(l)
        reach -= r or 0.0
    return frozenset(out)


def choose_draft(model_dir: Path, n_layers: int, k: int | None) -> tuple[int, int]:
    """(draft exit layer, k): for a given k the layer whose held-out agreement gives the best
    `speedup_estimate`; for k=None (auto) the best pair with k in 1..8, or k=0 (no speculation)
    when no pair is estimated to beat full depth. The agreement measured on greedily decoded text
    (calibrate) is preferred to the teacher-forced one (train-exits): drafts are made on the former."""
    from partition.config import load_config

    cfg = load_config(model_dir)
    record = read_record(model_dir)
    table = record.get("held_out_greedy_top1_agreement") or record.get("held_out_top1_agreement") or {}
    agree = {int(l): float(a) for l, a in dict(table).items()}  # type: ignore[call-overload]
    if not agree:
        raise ValueError(f"{model_dir}: the exit record has no held-out agreement; run orin-agent train-exits")
    ks = range(1, 9) if k is None else [k]
    best = max(((speedup_estimate(a, kk, l, cfg), l, kk) for l, a in agree.items() for kk in ks))
    if k is None and best[0] <= 1.0:
        return best[1], 0
    return best[1], best[2]


def accept(drafts: list[int], q: list[torch.Tensor], targets: list[torch.Tensor], greedy: bool,
           rng: torch.Generator) -> list[int]:
    """The tokens a round emits: the accepted drafts, then one token of the full model's.

    drafts: k tokens; q: their k draft distributions (sampling only); targets: k + 1 warped target
    logits (position i given the drafts before it). Greedy: keep drafts while they equal the
    target's argmax. Sampling: keep d_i with probability min(1, p(d_i) / q(d_i)); at the first
    rejection draw from max(0, p - q) renormalised; after k acceptances draw from p_(k+1)."""
    out: list[int] = []
    for i, x in enumerate(targets):
        if greedy:
            y = int(x.argmax())
            out.append(y)
            if i == len(drafts) or y != drafts[i]:
                break
            continue
        p = torch.softmax(x, -1)
        if i == len(drafts):
            out.append(int(torch.multinomial(p, 1, generator=rng)))
            break
        d = drafts[i]
        if float(torch.rand((), generator=rng)) * float(q[i][d]) <= float(p[d]):
            out.append(d)
            continue
        resid = (p - q[i]).clamp_min(0)
        out.append(int(torch.multinomial(resid / resid.sum() if float(resid.sum()) > 0 else p, 1, generator=rng)))
        break
    return out


class ExitExecutor(ChainExecutor):
    """exit_heads: "paying" computes an exit head only at the layers `paying_layers` finds worth it
    (a request with none runs as a plain row, batched with the others); "all" at every exit layer.
    verify=False: the last slice may be remote (exits only; speculation there fails with the reason)."""

    def __init__(self, chain: Chain, heads: ExitHeads, model_dir: Path, exit_heads: str = "paying",
                 verify: bool = True) -> None:
        super().__init__(chain)
        if exit_heads not in ("paying", "all"):
            raise ValueError(f"exit_heads must be 'paying' or 'all', got {exit_heads!r}")
        self.exits = ExitChain(chain, heads, verify)
        self.model_dir = model_dir
        self.exit_heads = exit_heads
        from partition.config import load_config

        self.cfg = load_config(model_dir)
        self.heads_at: dict[str, frozenset[int] | None] = {}  # request -> exit layers it computes heads at
        self.rows: dict[str, RowState] = {}
        self.prompt_len: dict[str, int] = {}  # tokens prefilled: how many a row has emitted follows from its position
        self.calibration: dict[str, Calibration | None] = {}
        self.stats = ExitStats(self.exits.n_layers)
        self.draft_layer: dict[int, int] = {}  # k -> the exit layer that drafts

    def exit_stats(self) -> dict[str, object]:
        return self.stats.as_dict()

    def reset_stats(self) -> None:
        self.stats = ExitStats(self.exits.n_layers)

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        for rid in plan.released:
            self.rows.pop(rid, None)
            self.calibration.pop(rid, None)
            self.prompt_len.pop(rid, None)
            self.heads_at.pop(rid, None)
        self._start(plan)
        special = [c for c in plan.chunks if self._mode(c) is not None]
        plain = [c for c in plan.chunks if self._mode(c) is None]
        tokens: dict[str, int] = {}
        more: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}  # plain rows only: SamplingParams refuses
        # logprobs with speculate / max_disagreement
        if plan.kind == "prefill" or not special:
            tokens, logprobs = self._forward(plan.chunks)  # every layer of every row: the caches are whole
            for c in special:
                self.rows[c.req_id] = self.exits.new_row(c.start_pos + len(c.token_ids))
                self.prompt_len[c.req_id] = c.start_pos + len(c.token_ids)
            if plan.kind == "prefill":
                return StepOutput(tokens, time.perf_counter() - t0, logprobs=logprobs)
            depth = _StepDepth(self.exits.n_layers)
            self._count_plain(plan.chunks, depth)
            return StepOutput(tokens, time.perf_counter() - t0, logprobs=logprobs, depth=self._record(depth))
        depth = _StepDepth(self.exits.n_layers)
        if plain:
            plain_tokens, logprobs = self._forward(plain)
            tokens.update(plain_tokens)
            self._count_plain(plain, depth)
        for c in special:
            s = self.samplers[c.req_id]
            if s.params.speculate:
                emitted = self._speculate(c, s, depth)
                tokens[c.req_id], more[c.req_id] = emitted[0], tuple(emitted[1:])
            else:
                tokens[c.req_id] = self._exit_step(c, s, depth)
        return StepOutput(tokens, time.perf_counter() - t0, more, logprobs, self._record(depth))

    def _count_plain(self, chunks: list[SeqChunk] | tuple[SeqChunk, ...], depth: _StepDepth) -> None:
        """Exit-mode rows that compute no head ran plain, at full depth: count them as such."""
        for c in chunks:
            if self.samplers[c.req_id].params.max_disagreement is not None:
                depth.token(self.exits.n_layers)
                depth.deep_passes += 1

    def _record(self, depth: _StepDepth) -> DepthStats | None:
        """The step's depth record, added to the running stats (None: no exit-mode row ran)."""
        step = depth.freeze()
        if step is not None:
            self.stats.add(step)
        return step

    def _mode(self, c: SeqChunk) -> str | None:
        p = self.samplers[c.req_id].params
        if p.speculate:
            return "speculate"
        if p.max_disagreement is None:
            return None
        at = self._heads_at(c.req_id, p.max_disagreement)
        return None if at is not None and not at else "exit"

    def _heads_at(self, rid: str, max_disagreement: float) -> frozenset[int] | None:
        """The exit layers this request computes heads at (None: every one; empty: none, so it runs plain)."""
        if rid not in self.calibration:
            cal = pick_calibration(self.model_dir, max_disagreement)
            self.calibration[rid] = cal
            at = None if self.exit_heads == "all" else (paying_layers(cal, self.cfg) if cal else frozenset())
            self.heads_at[rid] = at
            heads = "" if at is None else f"; heads at {sorted(at)}" if at else \
                "; no exit layer pays for its head: full depth"
            self.stats.targets[rid] = (f"target {cal.target}" if cal else "none that strict") + heads
        return self.heads_at[rid] if self.calibration[rid] is not None else frozenset()

    def _row(self, c: SeqChunk) -> RowState:
        st = self.rows.get(c.req_id)
        if st is None:
            raise KeyError(f"request {c.req_id}: decode before its prefill")
        return st

    # -- early exits ----------------------------------------------------------------------------
    def _exit_step(self, c: SeqChunk, s: Sampler, depth: _StepDepth) -> int:
        st = self._row(c)
        cal = self.calibration[c.req_id]
        thresholds = cal.thresholds if cal else {}

        def decide(layer: int, logits: torch.Tensor) -> bool:
            return float(torch.softmax(logits, -1).max()) >= thresholds.get(layer, float("inf"))

        s.history.extend(c.token_ids)
        before = st.deep_passes
        res = self.exits.step(st, c.slot, c.token_ids[0], c.start_pos, decide if thresholds else None,
                              heads_at=self.heads_at.get(c.req_id))
        depth.deep_passes += st.deep_passes - before
        depth.token(res.layer)
        return sample(res.logits, s.params, s.history, s.rng)

    # -- self-speculation -----------------------------------------------------------------------
    def _speculate(self, c: SeqChunk, s: Sampler, depth: _StepDepth) -> list[int]:
        st = self._row(c)
        p = c.start_pos
        if s.params.speculate not in self.draft_layer:
            self.draft_layer[s.params.speculate] = choose_draft(self.model_dir, self.exits.n_layers,
                                                                s.params.speculate)[0]
        layer = self.draft_layer[s.params.speculate]
        # no drafts past the request's budget: a round emits up to k + 1 tokens, and the row has emitted
        # p - prompt + 1 (the token fed now is its latest)
        left = s.params.max_tokens - (p - self.prompt_len.get(c.req_id, p) + 1)
        k = max(0, min(s.params.speculate, self.max_seq - 2 - p, left - 1))
        hist = list(s.history) + list(c.token_ids)
        drafts: list[int] = []
        q: list[torch.Tensor] = []  # the draft distributions (sampling only)
        token = c.token_ids[0]
        for i in range(k + 1):
            self.exits.step(st, c.slot, token, p + i, stop_at=layer)
            if i == k:
                break
            x = warp(self.exits.draft_logits(layer, st), s.params, hist + drafts)
            token = int(x.argmax()) if s.params.temperature == 0 else \
                int(torch.multinomial(torch.softmax(x, -1), 1, generator=s.rng))
            if s.params.temperature > 0:
                q.append(torch.softmax(x, -1))
            drafts.append(token)
        before = st.deep_passes
        logits = self.exits.finish(st, c.slot)[-(k + 1):]  # (k + 1, V): positions p .. p + k
        depth.deep_passes += st.deep_passes - before
        # target i sees the drafts before it: it only matters when all of them were accepted
        targets = [warp(logits[i], s.params, hist + drafts[:i]) for i in range(k + 1)]
        out = accept(drafts, q, targets, s.params.temperature == 0, s.rng)
        accepted = len(out) - 1
        self.exits.rollback(st, p + len(out))  # cache: t0 and the accepted drafts, not the last token
        s.history.extend(c.token_ids)
        s.history.extend(out[:-1])
        depth.drafted += k
        depth.accepted.append(accepted)
        depth.token(self.exits.n_layers, len(out))  # every emitted token is the full model's
        return out


def load_exit_executor(model: Path, backend: str = "torch", slices: str | None = None,
                       max_seq: int | None = None, device: str = "cpu", max_batch: int = 1,
                       exit_heads: str = "paying", loaded: "torch.nn.Module | None" = None) -> ExitExecutor:
    """A chain cut at the exit layers (and any slices asked for) with the heads beside the model.
    loaded: the model already in memory (e.g. a GGUF's blocks dequantised) for the torch backend."""
    from partition.checkpoint import load_model
    from partition.config import load_config
    from partition.exits.heads import load_heads
    from partition.runners import load_chain

    heads_model = loaded if loaded is not None else load_model(model, device=device)
    heads = load_heads(heads_model, model)
    n = load_config(model).n_layers
    cuts = set(heads.layers)
    if slices:
        cuts |= {int(part.split(":")[0]) for part in slices.split(",") if part.strip()} - {0}
    bounds = [0, *sorted(cuts), n]
    chain = load_chain(model, backend=backend, slices=",".join(f"{a}:{b}" for a, b in zip(bounds, bounds[1:])),
                       max_seq=max_seq, max_batch=max_batch, device=device, cuda_graphs=False,
                       model=heads_model if backend == "torch" else None)  # one copy of the weights
    return ExitExecutor(chain, heads, Path(model), exit_heads)


def exit_executor_on(chain: Chain, model: Path, device: str = "cpu") -> ExitExecutor:
    """Exits on a given chain (e.g. local slices cut at the exit layers + an edge server's deep slice):
    only the heads at the chain's inner boundaries are used, so a token exits where its hidden state
    already is. The last slice may be remote (exits only): speculation there fails with the reason.
    Every usable head is computed ("all"): `paying_layers` weighs a head against the weight reads it
    saves on the device, while here an exit also saves a round trip to the edge."""
    from partition.checkpoint import load_model
    from partition.exits.heads import load_heads

    heads = load_heads(load_model(model, device=device), model)
    inner = {r.spec.end for r in chain.runners[:-1]}
    usable = tuple(l for l in heads.layers if l in inner)
    if not usable:
        raise ValueError(f"no exit head at the chain's boundaries ({', '.join(str(r.spec) for r in chain.runners)}); "
                         f"heads are at layers {heads.layers}; run more layers here or drop --max-disagreement")
    return ExitExecutor(chain, heads.only(usable), Path(model), exit_heads="all", verify=False)
