"""The energy benchmark: a request trace replayed through the real controller against the twin, in
virtual time, for several policies side by side. The CLI is agent/cli/bench.py.

Per policy, on a fresh twin tree (tmpfs when there is one):
- a simple engine: prefill-first continuous batching up to ``max_batch`` sequences; a prefill step
  produces a request's first token, a decode step one token for every active sequence;
- each step's time and the workload it presents come from the cost model at the clocks the twin
  has settled on (``power.physics.costmodel``); the twin integrates power and temperature over the step;
- controller policies get the engine's phase events through :class:`power.applier.PowerLoop`, which
  writes through the journaled board layer into the twin tree; the twin re-reads its limits after
  each write and settles the new clocks for ``SETTLE_S`` (ORIN.md: GPU 5 ms, EMC 8 ms) before the
  step runs; the thermal zones are flushed and read at most once per second;
- baselines: MAXN + jetson_clocks (fixed maximum), and the stock governors (MAXN, and the board's
  boot default mode), written the same way (nvpmodel / jetson_clocks emulated on the twin).

Reported per policy: J/token (board energy of the whole trace, idle included, over output tokens),
TTFT and time per output token p50/p95, peak board power, hottest zone, time at or above the
passive trip, and the wall-clock cost of a phase switch (decide + writes) against a decode step.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from power.applier import PowerLoop, read_zone_samples
from power.control import open_session
from power.hw.backends import open_board
from power.physics.boards import board_for
from power.physics.costmodel import OperatingPoint, PRECISIONS, decode_step, model_shape, prefill_step
from power.policy.dvfs import PhaseIn
from power.policy.profiles import ProfileStore
from power.traces import Request, make_trace
from power.twin import IDLE, Twin, create_twin

SETTLE_S = 0.008            # a new EMC rate takes ~8 ms, GPU ~5 ms (ORIN.md, Orin NX/Nano measurement)
SAMPLE_S = 0.5              # timeline resolution for the plot
TRIP_C = 99.0               # fallback passive trip when the tree has none (ORIN.md)
BASELINES = ("maxn+jetson_clocks", "stock-maxn", "stock-default")
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
    switch_cost_us: float | None = None         # median wall time of decide + writes of a switch
    switch_cost_pct_of_decode: float | None = None
    messages: list[str] = field(default_factory=list)
    timeline: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _tmp_base() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


@dataclass
class _Seq:
    req: Request
    ctx: int
    left: int
    first_s: float


class _Run:
    """One policy on one twin tree."""

    def __init__(self, cfg: BenchConfig, policy: str, root: Path, trace: tuple[Request, ...]) -> None:
        self.cfg, self.policy, self.trace = cfg, policy, trace
        self.spec = board_for(cfg.board, cfg.l4t)
        self.shape = model_shape(cfg.shape)
        create_twin(root, cfg.board, cfg.l4t)
        run_dir = root / "run" / "orin-agent"
        self.loop: PowerLoop | None = None
        if policy in BASELINES:
            self.board = open_board(root)
            self.writer = self.board.writer(run_dir)
            if policy != "stock-default":
                self.board.set_mode("MAXN", self.writer)
            if policy == "maxn+jetson_clocks":
                open_board(root).set_jetson_clocks(self.writer)     # on the rediscovered MAXN tree
        else:
            store = ProfileStore(cfg.profile_dir)
            profile = store.load_doc("auto", AUTO_DOC) if policy == "auto" else store.load(policy)
            # the twin "reboots" for free: every policy runs at its profile's mode, as MAXN does above
            session = open_session(root, run_dir, profile, cfg.shape, precision=cfg.precision,
                                   fan_ours=cfg.fan == "ours", spec=self.spec, zones=self._zones,
                                   allow_reboot_modes=True)
            self.board, self.writer, self.loop = session.board, session.writer, session.loop
        self.twin = Twin(root, ambient_c=cfg.ambient_c, fan_daemon=cfg.fan == "daemon")
        self.trip_c = min((p for p, _, _ in self.twin.trips), default=TRIP_C * 1000) / 1000.0
        self._costs: dict[tuple[object, ...], Any] = {}
        self.t = 0.0
        self.switch_wall: list[float] = []
        self.decode_steps: list[float] = []
        self.above_trip_s = 0.0
        self.throttled_s = 0.0
        self.peak_w = 0.0
        self.max_c = 0.0
        self.tl: dict[str, list[float]] = {k: [] for k in ("t", "phase", "gpu_mhz", "emc_mhz", "power_w", "temp_c")}
        self._next_sample = 0.0

    def _zones(self) -> Any:
        self.twin.flush()
        return read_zone_samples(self.board)

    # -- events and time
    def _event(self, p: PhaseIn) -> None:
        if self.loop is None:
            return
        before = self.loop.stats.switches
        w0 = time.perf_counter()
        self.loop.on_event(p, self.t)
        wall = time.perf_counter() - w0
        if self.loop.stats.switches != before:
            # the cost of a phase switch: decide + writes. Sensor reads (once a second, on the
            # controller's own schedule) and the journal's first record of each file (fsync) are
            # not part of it, so those switches are left out of the measurement.
            if self.loop.stats.switches > 6 and self.loop.sensed_at != self.t:
                self.switch_wall.append(wall)
            self.twin.read_limits()
            self._run_for(SETTLE_S, IDLE if p.kind == "idle" else None, p.kind)

    def _tick_until(self, until: float) -> None:
        """Idle until ``until``, waking the controller when it asks."""
        while self.t < until - 1e-9:
            nxt = until
            if self.loop is not None and (w := self.loop.next_wake()) is not None and w > self.t:
                nxt = min(nxt, w)
            self._run_for(nxt - self.t, IDLE, "idle")
            if self.loop is not None and self.t >= (self.loop.next_wake() or float("inf")) - 1e-9:
                before = self.loop.stats.switches
                self.loop.tick(self.t)
                if self.loop.stats.switches != before:
                    self.twin.read_limits()

    def _run_for(self, dt: float, workload: Any, phase: str) -> None:
        if dt <= 0:
            return
        if workload is None:    # settling into a busy phase: the GPU is already busy at old clocks
            c = self.twin.state.clocks
            workload = self._cost(phase, c.gpu_hz, c.emc_hz, c.tpcs, 512, 1).workload(
                self.spec, OperatingPoint(c.gpu_hz, c.emc_hz, c.tpcs))
        self.twin.advance(dt, workload, max_dt_s=0.5)
        st = self.twin.state
        self.t += dt
        self.peak_w = max(self.peak_w, st.power.board_w)
        self.max_c = max(self.max_c, st.max_temp_c)
        if st.max_temp_c >= self.trip_c:
            self.above_trip_s += dt
        if st.throttle_steps:
            self.throttled_s += dt
        if self.t >= self._next_sample:
            self._next_sample = self.t + SAMPLE_S
            for k, v in (("t", self.t), ("phase", {"prefill": 0, "decode": 1, "idle": 2}[phase]),
                         ("gpu_mhz", st.clocks.gpu_hz / 1e6 if st.clocks.gpu_powered else 0.0),
                         ("emc_mhz", st.clocks.emc_hz / 1e6), ("power_w", st.power.board_w),
                         ("temp_c", st.max_temp_c)):
                self.tl[k].append(float(v))

    def _cost(self, kind: str, gpu: int, emc: int, tpcs: int, size: int, batch: int) -> Any:
        size = max(16, (size + 15) // 16 * 16)
        key = (kind, gpu, emc, tpcs, size, batch)
        c = self._costs.get(key)
        if c is None:
            op = OperatingPoint(gpu, emc, tpcs)
            c = (prefill_step(self.spec, self.shape, self.cfg.precision, op, size) if kind == "prefill"
                 else decode_step(self.spec, self.shape, self.cfg.precision, op, size, batch))
            self._costs[key] = c
        return c

    def _step(self, kind: str, size: int, batch: int) -> float:
        c = self.twin.state.clocks
        cost = self._cost(kind, c.gpu_hz, c.emc_hz, c.tpcs, size, batch)
        self._run_for(cost.seconds, cost.workload(self.spec, OperatingPoint(c.gpu_hz, c.emc_hz, c.tpcs)), kind)
        return cost.seconds

    # -- the engine
    def run(self) -> PolicyResult:
        pending = deque(self.trace)
        waiting: deque[Request] = deque()
        active: list[_Seq] = []
        ttft: list[float] = []
        tpot: list[float] = []
        tokens = 0
        self._event(PhaseIn("idle"))
        while pending or waiting or active:
            while pending and pending[0].arrival_s <= self.t + 1e-9:
                waiting.append(pending.popleft())
            if waiting and len(active) < self.cfg.max_batch:
                r = waiting.popleft()
                self._event(PhaseIn("prefill", n_tokens=r.prompt, batch=1))
                self._step("prefill", r.prompt, 1)
                ttft.append(self.t - r.arrival_s)
                tokens += 1
                if r.output > 1:
                    active.append(_Seq(r, r.prompt + 1, r.output - 1, self.t))
            elif active:
                ctx = sum(s.ctx for s in active) // len(active)
                self._event(PhaseIn("decode", context=max(s.ctx for s in active), batch=len(active)))
                self.decode_steps.append(self._step("decode", ctx, len(active)))
                tokens += len(active)
                for s in active:
                    s.ctx += 1
                    s.left -= 1
                    if s.left == 0:
                        tpot.append((self.t - s.first_s) / (s.req.output - 1))
                active = [s for s in active if s.left > 0]
            else:
                self._event(PhaseIn("idle"))
                self._tick_until(pending[0].arrival_s)
        self._event(PhaseIn("idle"))
        self._tick_until(max(self.t + 1.0, self.cfg.duration_s))
        st = self.twin.state
        res = PolicyResult(
            self.policy, st.energy_j / max(1, tokens), st.energy_j, tokens, len(self.trace), self.t,
            _pct(ttft, 0.5), _pct(ttft, 0.95), _pct(tpot, 0.5), _pct(tpot, 0.95), self.peak_w,
            st.energy_j / self.t, self.max_c, self.above_trip_s, self.throttled_s, timeline=self.tl)
        if self.loop is not None:
            s = self.loop.stats
            res.switches, res.writes, res.critical_entries = s.switches, s.writes, s.critical_entries
            res.messages = list(s.messages[:20])
            if self.switch_wall and self.decode_steps:
                cost = _pct(self.switch_wall, 0.5)
                res.switch_cost_us = cost * 1e6
                res.switch_cost_pct_of_decode = 100 * cost / (sum(self.decode_steps) / len(self.decode_steps))
        return res

    def close(self) -> None:
        """Put the twin tree back (journal restore): the same path as a service stop."""
        if self.writer.journal is not None:
            try:
                self.writer.journal.restore()
            finally:
                self.writer.journal.close()


def all_policies(cfg: BenchConfig) -> tuple[str, ...]:
    return cfg.policies or (*BASELINES, *ProfileStore(cfg.profile_dir).names(), "auto")


def run_bench(cfg: BenchConfig) -> list[PolicyResult]:
    """Every policy over the same seeded trace, each on a fresh twin tree."""
    try:
        board_for(cfg.board, cfg.l4t)
        model_shape(cfg.shape)
    except KeyError as exc:                     # the message names the valid boards / shapes
        raise ValueError(str(exc.args[0])) from None
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; allowed: {', '.join(PRECISIONS)}")
    if cfg.fan not in ("daemon", "off", "ours"):
        raise ValueError(f"unknown fan setting {cfg.fan!r}; allowed: daemon, ours, off")
    known = (*BASELINES, *ProfileStore(cfg.profile_dir).names(), "auto")
    for p in cfg.policies:
        if p not in known:
            raise ValueError(f"unknown policy {p!r}; allowed: {', '.join(known)}")
    trace = make_trace(cfg.trace, cfg.duration_s, cfg.seed)
    results = []
    for policy in all_policies(cfg):
        with tempfile.TemporaryDirectory(prefix="orin-bench-", dir=_tmp_base()) as d:
            run = _Run(cfg, policy, Path(d), trace)
            try:
                results.append(run.run())
            finally:
                run.close()
    return results


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
        from power.bench_plot import plot as draw
        draw(results, out / f"{stem}.png", f"{cfg.board} {cfg.shape} {cfg.precision}, trace {cfg.trace}, "
             f"ambient {cfg.ambient_c:g} °C, fan {cfg.fan}", 99.0)
        written.append(out / f"{stem}.png")
    return doc | {"written": written}
