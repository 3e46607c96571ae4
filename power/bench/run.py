"""One policy of the energy benchmark on one twin tree, in virtual time: the twin, the policy (a
baseline written like nvpmodel / jetson_clocks would, or the real controller behind
:class:`power.runtime.loop.PowerLoop`) and the accounting. An engine drives it (power.bench.energy.simple_driver,
or agent.benchmark.power_replay's driver over the service's real Scheduler) through four calls: ``event`` (a phase
event), ``step`` (run one prefill or decode step), ``idle_until`` and ``result``.

Time of a step: the step's work progresses at the rate the cost model (``power.physics.costmodel``) gives
for the clocks in force, integrated over the clock changes within the step (a governor ramps during
it), in chunks of at most ``CHUNK_S``. Every clock change takes ``SETTLE_S`` to take effect (ORIN.md: CPU
~1 ms, GPU ~5 ms, EMC ~8 ms after the write): a stock governor's within a step runs the first ``SETTLE_S``
after it at the old clocks' rate; the controller's, written at a phase event, stalls the work
``SWITCH_STALL_S`` (< 100 µs, same source) and then runs the next step's first ``SETTLE_S - SWITCH_STALL_S``
at the old clocks' rate.

The board the twin runs on is a :class:`power.bench.truth.BoardTruth`: the step times and rails come from
its constants (the exact model by default); the controller plans with the nominal ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from power.bench.truth import BoardTruth, exact
from power.runtime.loop import PowerLoop
from power.runtime.applier import read_zone_samples
from power.runtime.board import open_board_at
from power.runtime.session import open_session
from power.physics.boards import board_for
from power.physics.costmodel import OperatingPoint, StepCost, decode_step, prefill_step
from power.physics.equations import Clocks
from power.physics.exitcost import ExitRates, exit_decode_step
from power.policy.phase import PhaseEvent
from power.policy.powerconfig import Mix
from power.policy.profiles import Profile
from power.policy.thermal import ZoneSample
from power.runtime.shapes import model_shape
from power.twin import IDLE, Twin, Workload, create_twin

SETTLE_S = 0.008            # a new EMC rate takes ~8 ms, GPU ~5 ms (ORIN.md, Orin NX/Nano measurement)
SWITCH_STALL_S = 100e-6     # the switch itself stalls the work < 100 µs (same source)
CHUNK_S = 0.05              # step integration: at most one podgov sample period per chunk
SAMPLE_S = 0.5              # timeline resolution for the plot
TRIP_C = 99.0               # fallback passive trip when the tree has none (ORIN.md)
BASELINES = ("maxn+jetson_clocks", "stock-maxn", "stock-default")
MODE_PREFIX = "stock-mode:"     # "stock-mode:MODE_15W": that nvpmodel mode, stock governors
ENERGY_LOG_S = 0.05             # resolution of the cumulative energy log (sliding-window averages)


@dataclass
class Tally:
    """What the engine saw: per-request TTFT and time per output token, and tokens produced."""
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: int = 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _zone_key(name: str) -> str:
    """``cpu``, ``cpu-thermal`` (r36) and ``CPU-therm`` (r35) are one zone."""
    return name.lower().removesuffix("-thermal").removesuffix("-therm")


class PolicyRun:
    """One policy on one twin tree (made fresh under ``root``)."""

    def __init__(self, board: str, l4t: str, shape: str, precision: str, policy: str, root: Path, *,
                 ambient_c: float = 25.0, fan: str = "daemon", profile: Profile | None = None,
                 exits: ExitRates | None = None, exit_gate: bool = False, mix: Mix | None = None,
                 truth: BoardTruth | None = None) -> None:
        self.policy, self.precision = policy, precision
        self.exits, self.exit_gate = exits, exit_gate  # decode steps priced with early exits
        self.spec = board_for(board, l4t)           # what the controller plans with: the nominal constants
        self.truth = truth if truth is not None else exact(self.spec)   # what the twin runs on
        self.shape = model_shape(shape)
        create_twin(root, board, l4t)
        run_dir = root / "run" / "orin-agent"
        self.loop: PowerLoop | None = None
        if policy in BASELINES or policy.startswith(MODE_PREFIX):
            self.board = open_board_at(root)
            self.writer = self.board.writer(run_dir)
            if policy.startswith(MODE_PREFIX):      # a named nvpmodel mode under the stock governors
                self.board.set_mode(policy[len(MODE_PREFIX):], self.writer)
            elif policy != "stock-default":
                self.board.set_mode("MAXN", self.writer)
            if policy == "maxn+jetson_clocks":
                open_board_at(root).set_jetson_clocks(self.writer)     # on the rediscovered MAXN tree
        else:
            assert profile is not None, "a controller policy needs its profile"
            # the twin "reboots" for free: every policy runs at its profile's mode, as MAXN does above
            session = open_session(root, run_dir, profile, self.shape, precision=precision,
                                   fan_ours=fan == "ours", spec=self.spec, zones=self._zones,
                                   allow_reboot_modes=True, mix=mix, power=self)
            self.board, self.writer, self.loop = session.board, session.writer, session.loop
        self.twin = Twin(root, ambient_c=ambient_c, fan_daemon=fan == "daemon", spec=self.truth.spec,
                         emc_idle_floor_hz=self.truth.emc_idle_floor_hz)
        self.trip_c = min((p for p, _, _ in self.twin.trips), default=TRIP_C * 1000) / 1000.0
        self._costs: dict[tuple[object, ...], StepCost] = {}
        self._settle_from: Clocks | None = None       # the clocks before a controller switch (event)
        self.t = 0.0
        self.switch_wall: list[float] = []          # decide + writes of a switch
        self.sense_wall: list[float] = []           # the same when the thermal zones were read too
        self.decode_steps: list[float] = []
        self.energy = {"prefill": 0.0, "decode": 0.0, "idle": 0.0}
        self.seconds = {"prefill": 0.0, "decode": 0.0, "idle": 0.0}
        self.above_trip_s = self.throttled_s = self.peak_w = self.max_c = 0.0
        self.tl: dict[str, list[float]] = {k: [] for k in ("t", "phase", "gpu_mhz", "emc_mhz", "power_w", "temp_c")}
        self._next_sample = 0.0
        self.energy_log: list[tuple[float, float]] = [(0.0, self.twin.state.energy_j)]  # (t, board J so far)
        self.rail_names = tuple(n for n, _ in self.twin.state.power.rails)
        self._rail_j = [0.0] * len(self.rail_names)
        self.rail_log: list[tuple[float, tuple[float, ...]]] = [(0.0, tuple(self._rail_j))]  # (t, J so far per rail)
        self._zone_meta: tuple[ZoneSample, ...] | None = None
        self.sensor_read_s: float | None = None

    def reader(self, rail: str | None) -> Callable[[], float | None]:
        """A budget's power (the profile's ``[budget]``, installed by the session) as the twin has it: the
        module's power, or that rail's, W (power.runtime.meter.PowerSource)."""
        if rail is None:
            return lambda: self.twin.state.power.board_w
        return lambda: dict(self.twin.state.power.rails)[rail]

    def max_rows(self, engine_max: int) -> int | None:
        """The decode rows the budget lets the engine admit now (None: no budget)."""
        return self.loop.max_rows(engine_max) if self.loop is not None else None

    def _zones(self) -> tuple[ZoneSample, ...]:
        """The controller's sensor read. The zones' names and trip points are read through the board
        layer once (``measure_sensor_read``); the temperatures come from the twin's state, as the files
        would hold them (m°C): reading ~40 files through sysfs once a virtual second would make the
        hour-long trace take minutes. What a real read costs is measured apart and reported."""
        if self._zone_meta is None:
            self.measure_sensor_read()
        assert self._zone_meta is not None
        temps = {_zone_key(k): v for k, v in self.twin.state.temps_c.items()}
        return tuple(ZoneSample(z.name, round(temps[_zone_key(z.name)] * 1000) / 1000, z.trip_c)
                     for z in self._zone_meta)

    def measure_sensor_read(self, n: int = 5) -> float:
        """Median wall time of reading every thermal zone (temperature and trips) through the board
        layer, as the service's controller does once a second; keeps the zones' names and trips."""
        self.twin.flush()
        walls = []
        for _ in range(n):
            w0 = time.perf_counter()
            self._zone_meta = read_zone_samples(self.board)
            walls.append(time.perf_counter() - w0)
        self.sensor_read_s = pct(walls, 0.5)
        return self.sensor_read_s

    # -- the engine's calls
    def event(self, p: PhaseEvent) -> None:
        """A phase event: the controller decides (and writes); new limits take effect from now on."""
        if self.loop is None:
            return
        before = self.loop.stats.switches
        w0 = time.perf_counter()
        self.loop.on_event(p, self.t)
        wall = time.perf_counter() - w0
        if self.loop.stats.switches != before:
            # the journal's first record of each file (fsync) is not part of a switch's cost; a switch
            # that read the zones too is counted apart (with the real read's measured cost added)
            if self.loop.stats.switches > 6:
                if self.loop.sensed_at == self.t:
                    self.sense_wall.append(wall + (self.sensor_read_s or 0.0))
                else:
                    self.switch_wall.append(wall)
            old = self.twin.state.clocks
            self.twin.read_limits()
            self._run_for(SWITCH_STALL_S, None if p.kind != "idle" else IDLE, p.kind)
            now = self.twin.state.clocks
            # the controller's switch pays the settle a governor's pays (step): the next step's first
            # SETTLE_S run at the old clocks' rate
            moved = (now.gpu_hz, now.emc_hz, now.tpcs) != (old.gpu_hz, old.emc_hz, old.tpcs)
            self._settle_from = old if moved and p.kind != "idle" else None

    def step(self, kind: str, size: int, batch: int = 1, context: int = 0) -> float:
        """Run one step; returns its duration. Work progresses at the rate of the clocks in force."""
        t0, done = self.t, 0.0
        prev = self.twin.state.clocks
        if self._settle_from is not None:       # a controller switch just before the step
            old, self._settle_from = self._settle_from, None
            cost = self._cost(kind, old.gpu_hz, old.emc_hz, old.tpcs, size, batch, context)
            dt = min(SETTLE_S - SWITCH_STALL_S, cost.seconds)
            self._run_for(dt, cost.workload(self.truth.spec, OperatingPoint(old.gpu_hz, old.emc_hz, old.tpcs)), kind)
            done += dt / cost.seconds
        while done < 1.0 - 1e-9:
            cost = self._cost(kind, prev.gpu_hz, prev.emc_hz, prev.tpcs, size, batch, context)
            dt = min(CHUNK_S, (1.0 - done) * cost.seconds)
            self._run_for(dt, cost.workload(self.truth.spec, OperatingPoint(prev.gpu_hz, prev.emc_hz, prev.tpcs)), kind)
            now = self.twin.state.clocks
            if (now.gpu_hz, now.emc_hz, now.tpcs) == (prev.gpu_hz, prev.emc_hz, prev.tpcs):
                done += dt / cost.seconds
            else:       # the change takes SETTLE_S: until then the old clocks' rate
                new = self._cost(kind, now.gpu_hz, now.emc_hz, now.tpcs, size, batch, context)
                old_part = min(dt, SETTLE_S)
                done += old_part / cost.seconds + (dt - old_part) / new.seconds
            prev = now
        if kind == "decode":
            self.decode_steps.append(self.t - t0)
        return self.t - t0

    def idle_until(self, until: float) -> None:
        """Idle until ``until``, waking the controller when it asks."""
        self._settle_from = None
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

    # -- internals
    def _run_for(self, dt: float, workload: Workload | None, phase: str) -> None:
        if dt <= 0:
            return
        if workload is None:    # a switch in a busy phase: the GPU is busy at the old clocks
            c = self.twin.state.clocks
            workload = self._cost(phase, c.gpu_hz, c.emc_hz, c.tpcs, 512, 1, 0).workload(
                self.truth.spec, OperatingPoint(c.gpu_hz, c.emc_hz, c.tpcs))
        e0, r0 = self.twin.state.energy_j, self.twin.state.power.rails
        self.twin.advance(dt, workload, max_dt_s=0.5)
        st = self.twin.state
        for i, ((_, a), (_, b)) in enumerate(zip(r0, st.power.rails)):      # trapezoid per rail
            self._rail_j[i] += (a + b) / 2 * dt
        self.t += dt
        self.energy[phase] += st.energy_j - e0
        self.seconds[phase] += dt
        self.peak_w = max(self.peak_w, st.power.board_w)
        self.max_c = max(self.max_c, st.max_temp_c)
        if self.t - self.energy_log[-1][0] >= ENERGY_LOG_S:
            self.energy_log.append((self.t, st.energy_j))
            self.rail_log.append((self.t, tuple(self._rail_j)))
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

    def _cost(self, kind: str, gpu: int, emc: int, tpcs: int, size: int, batch: int, context: int) -> StepCost:
        size = max(16, (size + 15) // 16 * 16)
        context = context // 64 * 64
        key = (kind, gpu, emc, tpcs, size, batch, context)
        c = self._costs.get(key)
        if c is None:
            op = OperatingPoint(gpu, emc, tpcs)
            spec, params = self.truth.spec, self.truth.params
            if kind == "prefill":
                c = prefill_step(spec, self.shape, self.precision, op, size, context, params)
            elif self.exits is not None:
                c = exit_decode_step(spec, self.shape, self.precision, op, size, batch, self.exits, self.exit_gate,
                                     params)
            else:
                c = decode_step(spec, self.shape, self.precision, op, size, batch, params)
            self._costs[key] = c
        return c

    def close(self) -> None:
        """Put the twin tree back (journal restore): the same path as a service stop."""
        if self.writer.journal is not None:
            try:
                self.writer.journal.restore()
            finally:
                self.writer.journal.close()
