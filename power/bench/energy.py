"""The energy benchmark: a request trace replayed through the real controller against the twin, in
virtual time, for several policies side by side. The CLI is agent/cli/bench.py, which drives each policy
with the service's own Scheduler (agent.benchmark.power_replay); :func:`simple_driver` here is a plain
prefill-first engine for power's own tests. One policy on one twin tree is power.bench.run.PolicyRun
(the twin, the policy, the step-time integration and the accounting).

Per policy, on a fresh twin tree (tmpfs when there is one): baselines MAXN + jetson_clocks (every clock
pinned, CPU idle states and GPU rail-gating off, as NVIDIA's tool does), stock MAXN (default governors,
what most users run) and the board's boot default mode; the shipped profiles and ``auto`` run the
controller through :class:`power.runtime.loop.PowerLoop`, writing through the journaled board layer.

With ``boards`` (``--boards N``) every policy also runs on N boards drawn from the cited ranges of the
constants (power.bench.truth: the twin is then not the planner), the same N for every policy, and the
answer is each policy's saving against stock MAXN and against MAXN + jetson_clocks and its p95 TTFT / TPOT
change against MAXN + jetson_clocks, as fractions, median and worst over the boards (:func:`board_summary`),
beside the exact model's (board 0, the planner's own constants).

Reported per policy: J/token (board energy of the whole trace, idle included, over output tokens),
busy J/token (energy of prefill and decode steps over output tokens) and idle watts, TTFT and time per
output token p50/p95, peak board power, hottest zone, time at or above the passive trip, and the
controller's wall-clock cost per switch (p50/p95 of decide + writes; separately the switches that also
read the thermal zones).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from power.bench.run import BASELINES, PolicyRun, Tally, pct
from power.bench.truth import BoardTruth, exact, sample
from power.physics.boards import board_for
from power.physics.costmodel import PRECISIONS
from power.physics.exitcost import parse_exit_rates
from power.policy.phase import PhaseEvent
from power.policy.profiles import ProfileStore
from power.runtime.shapes import model_shape
from power.bench.traces import Request, make_trace

# `auto`: every busy clock chosen for least J/token under absolute latency targets only: 50 ms per
# output token (20 tok/s, faster than people read) and 1.5 s per prefill step (estimates of an
# interactive service's targets; the shipped profiles use slack relative to full speed instead).
AUTO_DOC: dict[str, Any] = {"include": "balanced",
                            "description": "least J/token within TPOT 50 ms and TTFT 1.5 s",
                            "latency": {"ttft_slack": 100.0, "tpot_slack": 100.0, "ttft_ms": 1500.0,
                                        "tpot_ms": 50.0}}


@dataclass(frozen=True)
class BenchConfig:
    board: str = "agx-orin-64gb"
    l4t: str = "r36"
    shape: str = "llama-3-8b"
    precision: str = "int4"
    trace: str = "chat"
    ambient_c: float = 25.0
    duration_s: float = 3600.0
    seed: int = 0
    max_batch: int = 8
    fan: str = "daemon"             # "daemon": nvfancontrol drives it; "off": no fan / failed fan
    policies: tuple[str, ...] = ()  # empty: every baseline, every shipped profile, auto
    profile_dir: str | None = None
    exit_rates: str | None = None   # early exits credited in decode steps: "2/8:0.034,..." (power.physics.exitcost)
    exit_gate: bool = False         # price an ideal gate (an exit head computed only where a token leaves)
    boards: int = 0                 # boards sampled from the constants' ranges (power.bench.truth), beside the exact model
    board_seed: int = 0


@dataclass
class PolicyResult:
    policy: str
    joules_per_token: float
    energy_j: float
    output_tokens: int
    requests: int
    duration_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    peak_power_w: float
    mean_power_w: float
    max_zone_c: float
    time_above_trip_s: float
    kernel_throttled_s: float
    switches: int = 0
    writes: int = 0
    critical_entries: int = 0
    busy_joules_per_token: float = 0.0          # prefill + decode steps' energy / output tokens
    idle_w: float = 0.0                         # mean board power while idle
    idle_s: float = 0.0
    switch_cost_us: float | None = None         # median wall time of decide + writes of a switch
    switch_cost_p95_us: float | None = None
    switch_sense_us: float | None = None        # median of the switches that also read the zones
    switch_cost_pct_of_decode: float | None = None
    messages: list[str] = field(default_factory=list)
    timeline: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


def _tmp_base() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


Driver = Callable[[PolicyRun, tuple[Request, ...], "BenchConfig"], Tally]


def simple_driver(run: PolicyRun, trace: tuple[Request, ...], cfg: "BenchConfig") -> Tally:
    """Prefill-first continuous batching up to ``max_batch`` sequences: a prefill step produces a
    request's first token, a decode step one token for every active sequence."""
    pending, waiting = list(trace), []
    active: list[list[Any]] = []           # [request, context, tokens left, first-token time]
    tally = Tally()
    run.event(PhaseEvent("idle"))
    while pending or waiting or active:
        while pending and pending[0].arrival_s <= run.t + 1e-9:
            waiting.append(pending.pop(0))
        if waiting and len(active) < cfg.max_batch:
            r = waiting.pop(0)
            run.event(PhaseEvent("prefill", n_tokens=r.prompt, context=r.prompt, batch=1))
            run.step("prefill", r.prompt, 1)
            tally.ttft_s.append(run.t - r.arrival_s)
            tally.tokens += 1
            if r.output > 1:
                active.append([r, r.prompt + 1, r.output - 1, run.t])
        elif active:
            run.event(PhaseEvent("decode", context=max(s[1] for s in active), batch=len(active)))
            run.step("decode", sum(s[1] for s in active) // len(active), len(active))
            tally.tokens += len(active)
            for s in active:
                s[1], s[2] = s[1] + 1, s[2] - 1
                if s[2] == 0:
                    tally.tpot_s.append((run.t - s[3]) / (s[0].output - 1))
            active = [s for s in active if s[2] > 0]
        else:
            run.event(PhaseEvent("idle"))
            run.idle_until(pending[0].arrival_s)
    return tally


def result(run: PolicyRun, tally: Tally, requests: int, duration_s: float) -> PolicyResult:
    """Close the trace (idle to its end) and account for it."""
    run.event(PhaseEvent("idle"))
    run.idle_until(max(run.t + 1.0, duration_s))
    st = run.twin.state
    busy_j = run.energy["prefill"] + run.energy["decode"]
    res = PolicyResult(
        run.policy, st.energy_j / max(1, tally.tokens), st.energy_j, tally.tokens, requests, run.t,
        pct(tally.ttft_s, 0.5), pct(tally.ttft_s, 0.95), pct(tally.tpot_s, 0.5), pct(tally.tpot_s, 0.95),
        run.peak_w, st.energy_j / run.t, run.max_c, run.above_trip_s, run.throttled_s,
        busy_joules_per_token=busy_j / max(1, tally.tokens),
        idle_w=run.energy["idle"] / max(1e-9, run.seconds["idle"]), idle_s=run.seconds["idle"],
        timeline=run.tl)
    if run.loop is not None:
        s = run.loop.stats
        res.switches, res.writes, res.critical_entries = s.switches, s.writes, s.critical_entries
        res.messages = list(s.messages[:20])
        if run.switch_wall and run.decode_steps:
            cost = pct(run.switch_wall, 0.5)
            res.switch_cost_us = cost * 1e6
            res.switch_cost_p95_us = pct(run.switch_wall, 0.95) * 1e6
            res.switch_cost_pct_of_decode = 100 * cost / (sum(run.decode_steps) / len(run.decode_steps))
        if run.sense_wall:
            res.switch_sense_us = pct(run.sense_wall, 0.5) * 1e6
    return res


def all_policies(cfg: BenchConfig) -> tuple[str, ...]:
    return cfg.policies or (*BASELINES, *ProfileStore(cfg.profile_dir).names(), "auto")


def run_bench(cfg: BenchConfig, driver: Driver = simple_driver, truth: BoardTruth | None = None) -> list[PolicyResult]:
    """Every policy over the same seeded trace, each on a fresh twin tree of the board ``truth`` (the exact
    model when None), driven by ``driver``."""
    try:
        board_for(cfg.board, cfg.l4t)
        model_shape(cfg.shape)
    except KeyError as exc:                     # the message names the valid boards / shapes
        raise ValueError(str(exc.args[0])) from None
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; allowed: {', '.join(PRECISIONS)}")
    exits = parse_exit_rates(cfg.exit_rates) if cfg.exit_rates else None
    if cfg.fan not in ("daemon", "off", "ours"):
        raise ValueError(f"unknown fan setting {cfg.fan!r}; allowed: daemon, ours, off")
    known = (*BASELINES, *ProfileStore(cfg.profile_dir).names(), "auto")
    for p in cfg.policies:
        if p not in known:
            raise ValueError(f"unknown policy {p!r}; allowed: {', '.join(known)}")
    trace = make_trace(cfg.trace, cfg.duration_s, cfg.seed)
    results = []
    store = ProfileStore(cfg.profile_dir)
    for policy in all_policies(cfg):
        profile = None if policy in BASELINES else (
            store.load_doc("auto", AUTO_DOC) if policy == "auto" else store.load(policy))
        with tempfile.TemporaryDirectory(prefix="orin-bench-", dir=_tmp_base()) as d:
            run = PolicyRun(cfg.board, cfg.l4t, cfg.shape, cfg.precision, policy, Path(d),
                            ambient_c=cfg.ambient_c, fan=cfg.fan, profile=profile, exits=exits,
                            exit_gate=cfg.exit_gate, truth=truth)
            try:
                results.append(result(run, driver(run, trace, cfg), len(trace), cfg.duration_s))
            finally:
                run.close()
    return results


@dataclass(frozen=True)
class BoardRun:
    """Every policy on one board."""
    truth: BoardTruth
    results: list[PolicyResult]


def run_boards(cfg: BenchConfig, driver: Driver = simple_driver) -> list[BoardRun]:
    """Every policy on the exact model and on ``cfg.boards`` boards sampled from the constants' ranges (the
    same boards for every policy, drawn from ``cfg.board_seed``)."""
    if cfg.boards < 0:
        raise ValueError(f"--boards {cfg.boards}: must be 0 or more")
    try:
        spec = board_for(cfg.board, cfg.l4t)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    return [BoardRun(t, run_bench(cfg, driver, t)) for t in (exact(spec), *sample(spec, cfg.boards, cfg.board_seed))]


OUTCOMES = ("saving_vs_stock_maxn", "saving_vs_maxn_jc", "ttft_p95_change", "tpot_p95_change")


def outcomes(results: list[PolicyResult]) -> dict[str, dict[str, float]]:
    """Per policy on one board, as fractions: J/token saved against stock MAXN and against MAXN +
    jetson_clocks (positive: a saving), and the p95 TTFT and TPOT change against MAXN + jetson_clocks
    (positive: slower). Empty without both baselines."""
    by = {r.policy: r for r in results}
    jc, stock = by.get("maxn+jetson_clocks"), by.get("stock-maxn")
    if jc is None or stock is None:
        return {}
    return {r.policy: {"saving_vs_stock_maxn": 1 - r.joules_per_token / stock.joules_per_token,
                       "saving_vs_maxn_jc": 1 - r.joules_per_token / jc.joules_per_token,
                       "ttft_p95_change": r.ttft_p95_s / jc.ttft_p95_s - 1,
                       "tpot_p95_change": r.tpot_p95_s / jc.tpot_p95_s - 1} for r in results}


def board_summary(runs: list[BoardRun]) -> dict[str, Any]:
    """The bench's answer over the sampled boards: per policy, each outcome's median and worst (least
    saving, largest slow-down) over them, beside the exact model's (board 0) and one row per board."""
    per = [(run.truth, outcomes(run.results)) for run in runs]
    policies = [r.policy for r in runs[0].results]
    summary = []
    for p in policies:
        row: dict[str, Any] = {"policy": p, "boards": len(per) - 1}
        for k in OUTCOMES:
            xs = [o[p][k] for t, o in per if t.index > 0 and p in o]
            if xs:
                row[k] = {"median": statistics.median(xs), "worst": min(xs) if k.startswith("saving") else max(xs)}
            else:
                row[k] = None
        row["exact_model"] = {k: v for t, o in per if t.index == 0 and p in o for k, v in o[p].items()}
        summary.append(row)
    rows = [{"board": t.index, "label": t.label, "policy": p, **o[p],
             "joules_per_token": next(r.joules_per_token for r in run.results if r.policy == p)}
            for run, (t, o) in zip(runs, per) for p in o]
    return {"summary": summary, "per_board": rows, "boards": [run.truth.record() for run in runs]}


def compare(results: list[PolicyResult], baseline: str = "maxn+jetson_clocks") -> dict[str, dict[str, float]]:
    """Per policy: % change of J/token, p95 TPOT and p95 TTFT against the baseline."""
    base = next((r for r in results if r.policy == baseline), None)
    if base is None:
        return {}
    out = {}
    for r in results:
        out[r.policy] = {
            "energy_per_token_pct": 100 * (r.joules_per_token / base.joules_per_token - 1),
            "tpot_p95_pct": 100 * (r.tpot_p95_s / base.tpot_p95_s - 1),
            "ttft_p95_pct": 100 * (r.ttft_p95_s / base.ttft_p95_s - 1),
        }
    return out


def default_out_dir() -> Path:
    """Where results go without ``--out``: the user's cache (``$XDG_CACHE_HOME`` or ~/.cache), never the
    current folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orin-agent" / "bench-power"


def save_board_results(cfg: BenchConfig, runs: list[BoardRun], out: Path, *, plot: bool = True) -> dict[str, Any]:
    """Write ``power-<trace>-<ambient>C-boards<N>.json`` (the summary over the boards, every board's rows and
    what was drawn) beside the exact model's own file and plot; returns the summary document (summary
    first) with the paths written under ``"written"``."""
    doc = board_summary(runs) | {"config": cfg.__dict__}
    exact_doc = save_results(cfg, runs[0].results, out, plot=plot)
    path = out / f"power-{cfg.trace}-{cfg.ambient_c:g}C-boards{cfg.boards}.json"
    full = doc | {"results": [{"board": run.truth.index, "results": [r.record() for r in run.results]} for run in runs]}
    path.write_text(json.dumps(full, indent=1, default=str))
    return doc | {"written": [path, *exact_doc["written"]]}


def save_results(cfg: BenchConfig, results: list[PolicyResult], out: Path, *, plot: bool = True) -> dict[str, Any]:
    """Write ``power-<trace>-<ambient>C.json`` (and the PNG plot) into ``out``; returns the document
    with the paths written under ``"written"``."""
    deltas = compare(results)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"power-{cfg.trace}-{cfg.ambient_c:g}C"
    doc: dict[str, Any] = {"config": cfg.__dict__ | {"policies": [r.policy for r in results]},
                           "results": [r.record() | {"vs_maxn": deltas.get(r.policy)} for r in results]}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    written = [out / f"{stem}.json"]
    if plot:
        from power.bench.plot import plot as draw
        draw(results, out / f"{stem}.png", f"{cfg.board} {cfg.shape} {cfg.precision}, trace {cfg.trace}, "
             f"ambient {cfg.ambient_c:g} °C, fan {cfg.fan}", 99.0)
        written.append(out / f"{stem}.png")
    return doc | {"written": written}
