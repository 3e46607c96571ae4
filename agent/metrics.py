"""Prometheus metrics of one service instance (its own registry, so several can live in one process).

The engine reports through the `EngineMetrics` methods (called on the engine thread); board readings
(clocks, zone temperatures, rail power) come at scrape time from the board meter's last sample
(power.runtime.meter: taken by the power thread at every phase event and at least once a second), so a
scrape never reads the board itself.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.engine.types import MAX_SPECULATE, DepthStats, StepPlan, Usage
from power.runtime.meter import BoardSnapshot

PHASES = ("prefill", "decode", "idle")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DRAFT_BUCKETS = tuple(range(MAX_SPECULATE + 1))  # accepted draft tokens per round
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _BoardCollector(Collector):
    def __init__(self, snapshot: Callable[[], BoardSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        power = GaugeMetricFamily("orin_agent_board_power_watts", "Board power (VDD_IN or the sum of rails)")
        if snap.power_mw is not None:
            power.add_metric([], snap.power_mw / 1000.0)
        yield power
        rails = GaugeMetricFamily("orin_agent_rail_power_watts", "Power per INA3221 rail", labels=["rail"])
        for label, mw in sorted(snap.rails_mw.items()):
            rails.add_metric([label], mw / 1000.0)
        yield rails
        temps = GaugeMetricFamily("orin_agent_zone_temperature_celsius", "Thermal zone temperature",
                                  labels=["zone"])
        for zone, c in sorted(snap.temps_c.items()):
            temps.add_metric([zone], c)
        yield temps
        clocks = GaugeMetricFamily("orin_agent_clock_hertz", "Current clock", labels=["domain"])
        if snap.gpu_hz is not None:
            clocks.add_metric(["gpu"], snap.gpu_hz)
        if snap.emc_hz is not None:
            clocks.add_metric(["emc"], snap.emc_hz)
        yield clocks


class _BudgetCollector(Collector):
    """The power budget's gauges (power.policy.budget), read at scrape time; none without a budget."""
    GAUGES = (("orin_agent_power_budget_watts", "watts", "Power budget: ceiling on the window average"),
              ("orin_agent_power_window_average_watts", "window_avg_w", "Board power averaged over the budget's window"),
              ("orin_agent_power_budget_headroom_watts", "headroom_w", "Budget less the window average"),
              ("orin_agent_power_budget_window_seconds", "window_s", "The budget's sliding window"),
              ("orin_agent_power_budget_unmet", "unmet", "1 when the budget cannot be met even at the floor"))

    def __init__(self, status: Callable[[], Mapping[str, float | int | bool] | None]) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.status()
        if st is None:
            return
        for name, key, doc in self.GAUGES:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(st[key]))
            yield g


class _EdgeCollector(Collector):
    """The offload link's state (partition.offload.offload_chain.offload_stats), read at scrape time."""
    GAUGES = (("orin_agent_edge_rtt_seconds", "rtt_ms", 1e-3, "Link RTT, moving average of single-position exchanges"),
              ("orin_agent_edge_bandwidth_mbps", "mbps", 1.0, "Link bandwidth from multi-position exchanges"))
    COUNTERS = (("orin_agent_edge_round_trips", "round_trips", "Exchanges with the edge server"),
                ("orin_agent_edge_bytes", "bytes", "Bytes over the link, both ways"),
                ("orin_agent_edge_retries", "retries", "Retried exchanges"),
                ("orin_agent_edge_rebuilds", "rebuilds", "Sessions rebuilt on the edge from the device's history"),
                ("orin_agent_edge_fallbacks", "fallbacks", "Sequences moved to the local deep layers by a fault"))
    POLICY = (("orin_agent_edge_replans", "replans", "Re-plans of the split on the measured link"),
              ("orin_agent_edge_switches", "switches", "Changes between offload and device only"),
              ("orin_agent_edge_probes", "probes", "Probes of the edge while device only"))

    def __init__(self, stats: Callable[[], Mapping[str, object]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.stats()
        if not st:
            return
        st = {**st, "bytes": int(st["bytes_up"]) + int(st["bytes_down"])}  # type: ignore[call-overload]
        for name, key, scale, doc in self.GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(st[key]) * scale)  # type: ignore[arg-type]
        for name, key, doc in self.COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(st[key]))  # type: ignore[arg-type]
        pol = st.get("replan")
        if not isinstance(pol, Mapping):
            return
        yield GaugeMetricFamily("orin_agent_edge_device_layers", "Layers new sequences run on the device now "
                                "(the split N, or every layer when device only)", value=float(pol["device_layers"]))
        yield GaugeMetricFamily("orin_agent_edge_device_only", "1 while new sequences run every layer here",
                                value=1.0 if pol["choice"] == "device" else 0.0)
        yield GaugeMetricFamily("orin_agent_edge_link_down", "1 while the edge counts as down (until a probe "
                                "answers)", value=1.0 if pol["link_down"] else 0.0)
        for name, key, doc in self.POLICY:
            yield CounterMetricFamily(name, doc, value=float(pol[key]))


class ServiceMetrics:
    def __init__(self, board_snapshot: Callable[[], BoardSnapshot] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("orin_agent_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.disconnects = Counter("orin_agent_client_disconnects", "Clients that left before their answer "
                                   "(counted as status 499, never 5xx), by endpoint and stage (body: before the "
                                   "request body was in; answer: while it was being answered)",
                                   ["endpoint", "stage"], registry=r)
        self.finished = Counter("orin_agent_requests_finished", "Engine requests by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("orin_agent_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("orin_agent_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("orin_agent_time_to_first_token_seconds", "Submit to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("orin_agent_inter_token_latency_seconds", "Time between tokens",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram("orin_agent_step_seconds", "Engine step time", ["phase"],
                                      buckets=TOKEN_BUCKETS + (5, 10), registry=r)
        self.queue_depth = Gauge("orin_agent_queue_depth", "Requests waiting for a cache slot", registry=r)
        self.running = Gauge("orin_agent_running_requests", "Requests holding a cache slot", registry=r)
        self.phase = Gauge("orin_agent_phase", "1 for the engine's current phase", ["phase"], registry=r)
        self.energy = Counter("orin_agent_energy_joules", "Energy of engine steps by phase", ["phase"],
                              registry=r)
        self.joules_per_token = Gauge("orin_agent_joules_per_token",
                                      "Energy per generated token of the last finished request", registry=r)
        for p in PHASES:
            self.phase.labels(p).set(1 if p == "idle" else 0)
        # early exits and self-speculation (agent.engine.speculative): only rows that asked for them
        self.exit_tokens = Counter("orin_agent_exit_tokens", "Tokens whose logits were read at an early exit "
                                   "layer (max_disagreement requests)", ["layer"], registry=r)
        self.full_depth_tokens = Counter("orin_agent_full_depth_tokens", "Tokens of exit-mode or speculative "
                                         "requests read at full depth", registry=r)
        self.deep_passes = Counter("orin_agent_deep_passes", "Runs of the last slice for exit-mode or "
                                   "speculative requests (per token: / their tokens)", registry=r)
        self.deep_passes_per_token = Gauge("orin_agent_deep_passes_per_token", "Deep passes per exit-mode or "
                                           "speculative token since the start", registry=r)
        self.drafted = Counter("orin_agent_speculative_drafted_tokens", "Draft tokens proposed by an exit "
                               "head", registry=r)
        self.accepted = Histogram("orin_agent_speculative_accepted_length", "Draft tokens the full model "
                                  "accepted, per speculative round", buckets=DRAFT_BUCKETS, registry=r)
        self._depth_tokens = 0
        self._deep_passes = 0
        if board_snapshot is not None:
            r.register(_BoardCollector(board_snapshot))

    def watch_budget(self, status: Callable[[], Mapping[str, float | int | bool] | None]) -> None:
        """Export the power budget's gauges (budget, window average, headroom) from ``status`` at scrape time."""
        self.registry.register(_BudgetCollector(status))

    def watch_edge(self, stats: Callable[[], Mapping[str, object]]) -> None:
        """Export the offload link's counters and the re-planning state from ``stats`` at scrape time."""
        self.registry.register(_EdgeCollector(stats))

    # EngineMetrics
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token(self, latency_s: float) -> None:
        self.token_latency.observe(latency_s)

    def on_step(self, plan: StepPlan, elapsed_s: float, joules: float | None) -> None:
        self.step_seconds.labels(plan.kind).observe(elapsed_s)
        if plan.kind == "prefill":
            self.prompt_tokens.inc(plan.n_tokens)
        if joules is not None:
            self.energy.labels(plan.kind).inc(joules)

    def on_finished(self, reason: str, usage: Usage) -> None:
        self.finished.labels(reason).inc()
        self.completion_tokens.inc(usage.completion_tokens)
        if usage.energy_joules is not None and usage.completion_tokens:
            self.joules_per_token.set(usage.energy_joules / usage.completion_tokens)

    def on_depth(self, depth: DepthStats) -> None:
        for layer, n in depth.exits:
            if layer == depth.n_layers:
                self.full_depth_tokens.inc(n)
            else:
                self.exit_tokens.labels(str(layer)).inc(n)
        self.deep_passes.inc(depth.deep_passes)
        self.drafted.inc(depth.drafted)
        for a in depth.accepted:
            self.accepted.observe(a)
        self._depth_tokens += depth.tokens
        self._deep_passes += depth.deep_passes
        if self._depth_tokens:
            self.deep_passes_per_token.set(self._deep_passes / self._depth_tokens)

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def on_phase(self, kind: str) -> None:
        for p in PHASES:
            self.phase.labels(p).set(1 if p == kind else 0)

    def on_http(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def on_disconnect(self, endpoint: str, stage: str) -> None:
        self.disconnects.labels(endpoint, stage).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
