"""The twin's board model: reads the limits the agent wrote into a twin tree, settles the clocks as
devfreq / cpufreq / the EMC bandwidth manager would, and writes back rail readings, temperatures,
GPU load and EMC activity.

Two ways to drive it:
- virtual time (benchmarks): ``read_limits()`` after the agent's writes, ``step(dt, workload)`` as
  often as needed (memory only, no sleeping, no I/O), ``flush()`` when something should read the
  files. ``state`` is the ground truth (clocks, rails, temperatures, energy so far).
- real time (``orin-agent twin run``): ``run()`` reads limits and ``workload.json`` every period,
  steps by the wall time that passed and flushes (atomic writes, so concurrent readers never see a
  half-written file).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from power.physics.boards import BoardSpec, active_tpcs, board_for
from power.hw.tables import snap
from power.twin.layout import WORKLOAD_FILE, ZONE_KINDS, TwinPaths, read_meta, twin_paths
from power.physics.equations import (IDLE, PHASES, Workload, FAN_POLL_S, PHASE_CPU_CORES, PHASE_INTENSITY,
                                     EMC_IDLE_FLOOR_HZ, Activity, Clocks, Power, Temperatures, clamp_to_limits,
                                     cpu_governor, emc_governor, fan_curve, gpu_governor, power, thermal_step)

log = logging.getLogger(__name__)

# cpuidle's deepest state (c7 on Orin; `jetson_clocks --show` prints `IdleStates: WFI=1 c7=1`, 0 after it runs)
CPUIDLE_DISABLE = "cpuidle/state1/disable"
RAILGATE_DELAY_S = 0.5          # estimate: nvgpu rail-gates an idle GPU after ~500 ms
THERMAL_POLL_S = 1.0            # polling-delay-passive = 1000 ms in the upstream T234 zones




@dataclass(frozen=True)
class TwinLimits:
    """The knobs the agent (or nvpmodel, or jetson_clocks) set in the tree."""
    gpu_min_hz: int
    gpu_max_hz: int
    gpu_governor: str
    emc_locked: bool
    emc_rate_hz: int                # the requested rate when locked
    emc_min_hz: int
    emc_max_hz: int                 # min(max_rate, nvpmodel caps)
    cpu_min_khz: tuple[int, ...]    # per cluster
    cpu_max_khz: tuple[int, ...]
    cpu_governor: tuple[str, ...]
    cpu_online: tuple[int, ...]     # online cores per cluster
    tpc_pg_mask: int
    railgate: bool
    fan_pwm: int                    # what pwm1 holds (ours when the fan daemon is off)
    cpu_idle_states: bool = True    # cpu0's deepest idle state enabled (jetson_clocks disables them)


@dataclass(frozen=True)
class TwinState:
    """A snapshot of the board. Temperatures in °C, power in W, energy in J since the start."""
    t_s: float
    clocks: Clocks
    power: Power
    thermal: Temperatures
    zone_names: tuple[str, ...]
    fan_pwm: int
    gpu_load: float                 # 0..1 (the file holds per-mille)
    emc_util: float                 # 0..1 of the current rate's bandwidth
    energy_j: float
    throttle_steps: int             # passive-trip throttling in force (0 = none)
    shutdown: bool                  # a zone crossed its critical trip: the board is off

    @property
    def temps_c(self) -> dict[str, float]:
        return dict(zip(self.zone_names, self.thermal.zones_c))

    @property
    def max_temp_c(self) -> float:
        return max(self.thermal.zones_c)


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text().strip()
    except OSError:
        return None


def _int(root: Path, rel: str, default: int) -> int:
    text = _read(root, rel)
    if not text:        # missing, or read between a writer's truncate and its write: keep the last value
        return default
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        log.warning("twin: %s holds %r, not an integer; keeping %d", rel, text, default)
        return default


@dataclass
class _Runtime:
    """Mutable model state between steps (kept apart from the frozen spec and snapshots)."""
    gpu_idle_s: float = 0.0
    thermal_acc_s: float = 0.0
    fan_acc_s: float = 0.0
    written: dict[str, str] = field(default_factory=dict)
    failed_zones: set[int] = field(default_factory=set)
    absent: set[str] = field(default_factory=set)      # readings the tree lacks: never created


class Twin:
    """The board model on a tree made by ``create_twin``."""

    def __init__(self, root: Path | str, ambient_c: float = 25.0, fan_daemon: bool = True,
                 atomic_writes: bool = False, *, spec: BoardSpec | None = None,
                 emc_idle_floor_hz: int = EMC_IDLE_FLOOR_HZ) -> None:
        """``spec`` replaces the board's own constants (a board sampled from their ranges,
        power.bench.truth; its tables and modes must be the tree's board's); ``emc_idle_floor_hz``: the
        rate the EMC bandwidth manager idles at under stock governors."""
        self.root = Path(root)
        board, l4t = read_meta(self.root)
        self.board, self.l4t = board, l4t
        self.spec: BoardSpec = board_for(board, l4t) if spec is None else spec
        self.emc_idle_floor_hz = emc_idle_floor_hz
        self.paths: TwinPaths = twin_paths(self.spec, l4t)
        self.ambient_c = ambient_c
        self.fan_daemon = fan_daemon
        self.atomic_writes = atomic_writes
        self._rt = _Runtime()
        self.trips = self._read_trips()
        self.limits = self.read_limits()
        lim = self.limits
        clocks = Clocks(gpu_hz=clamp_to_limits(self.spec.gpu_hz, 0, lim.gpu_min_hz, lim.gpu_max_hz),
                        emc_hz=_int(self.root, f"{self.paths.emc}/rate", self.spec.emc_hz[0]),
                        tpcs=active_tpcs(self.spec, lim.tpc_pg_mask),
                        cpu_khz=lim.cpu_min_khz, cpu_online=lim.cpu_online, gpu_powered=False)
        kinds = ZONE_KINDS
        th = Temperatures(ambient_c, tuple(ambient_c for _ in kinds))
        act = Activity(0.0, 0.0, 0.0, 0.0)
        self.state = TwinState(0.0, clocks, power(self.spec, clocks, act), th,
                               self.paths.thermal_zone_types, lim.fan_pwm, 0.0, 0.0, 0.0, 0, False)

    # --- reading what the agent wrote ----------------------------------------------------------

    def _read_trips(self) -> tuple[tuple[int, int, int], ...]:
        """(passive °mC, passive hyst, critical °mC) per zone, read from the tree's trip points."""
        out = []
        for i in range(len(self.paths.thermal_zone_types)):
            z = self.paths.zone(i)
            passive, hyst, critical = 99000, 0, 104500
            n = 0
            while (kind := _read(self.root, f"{z}/trip_point_{n}_type")) is not None:
                temp = _int(self.root, f"{z}/trip_point_{n}_temp", 0)
                if kind == "passive":
                    passive, hyst = temp, _int(self.root, f"{z}/trip_point_{n}_hyst", 0)
                elif kind == "critical":
                    critical = temp
                n += 1
            out.append((passive, hyst, critical))
        return tuple(out)

    def read_limits(self) -> TwinLimits:
        """Re-read every knob from the tree (about 30 small reads). Call after the agent writes."""
        r, p, s = self.root, self.paths, self.spec
        prev = getattr(self, "limits", None)
        d = p.gpu_devfreq
        caps = [c for c in (_int(r, f, 0) for f in p.emc_caps) if c > 0]
        emc_max = min([_int(r, f"{p.emc}/max_rate", s.emc_max_hz)] + caps)
        mins, maxs, govs, online = [], [], [], []
        for cluster in s.cpu_clusters:
            pol = p.policy(cluster[0])
            mins.append(_int(r, f"{pol}/scaling_min_freq", s.cpu_khz[0]))
            maxs.append(_int(r, f"{pol}/scaling_max_freq", s.cpu_khz[-1]))
            govs.append(_read(r, f"{pol}/scaling_governor") or "schedutil")
            # cpu0 cannot go offline (ORIN.md), whatever its file says
            online.append(sum(1 for c in cluster
                              if c == 0 or _int(r, f"{p.cpu}/cpu{c}/online", 1) == 1))
        fan = _int(r, f"{p.fan_hwmon}/pwm1", prev.fan_pwm if prev else 0)
        lim = TwinLimits(
            gpu_min_hz=_int(r, f"{d}/min_freq", prev.gpu_min_hz if prev else s.gpu_hz[0]),
            gpu_max_hz=_int(r, f"{d}/max_freq", prev.gpu_max_hz if prev else s.gpu_max_hz),
            gpu_governor=_read(r, f"{d}/governor") or "nvhost_podgov",
            emc_locked=_int(r, f"{p.emc}/mrq_rate_locked", 0) == 1,
            emc_rate_hz=_int(r, f"{p.emc}/rate", s.emc_max_hz),
            emc_min_hz=_int(r, f"{p.emc}/min_rate", s.emc_hz[0]), emc_max_hz=emc_max,
            cpu_min_khz=tuple(mins), cpu_max_khz=tuple(maxs), cpu_governor=tuple(govs),
            cpu_online=tuple(online), tpc_pg_mask=_int(r, f"{p.gpu0}/tpc_pg_mask", 0),
            railgate=_int(r, f"{p.gpu0}/railgate_enable", 1) == 1, fan_pwm=max(0, min(255, fan)),
            cpu_idle_states=_int(r, f"{p.cpu}/cpu0/{CPUIDLE_DISABLE}", 0) == 0)
        self.limits = lim
        return lim

    def read_workload(self) -> Workload | None:
        """The workload the engine wrote, or ``None`` if the file is missing or malformed."""
        text = _read(self.root, WORKLOAD_FILE)
        if text is None:
            return None
        try:
            return Workload.from_json(text)
        except (ValueError, TypeError, AttributeError) as e:
            log.warning("twin: ignoring %s: %s", WORKLOAD_FILE, e)
            return None

    # --- the model --------------------------------------------------------------------------------

    def _settle(self, dt: float, w: Workload, throttle: int) -> Clocks:
        """The clocks the kernel's governors settle on within the limits."""
        s, lim, prev = self.spec, self.limits, self.state.clocks
        gpu_hi = lim.gpu_max_hz
        cpu_hi = list(lim.cpu_max_khz)
        if throttle:        # passive trip: the step-wise governor walks the caps down a table step
            gpu_hi = min(gpu_hi, s.gpu_hz[max(0, len(s.gpu_hz) - 1 - throttle)])
            cpu_hi = [min(h, s.cpu_khz[max(0, len(s.cpu_khz) - 1 - 2 * throttle)]) for h in cpu_hi]
        gpu = gpu_governor(lim.gpu_governor, s.gpu_hz, prev.gpu_hz, w.gpu_util, lim.gpu_min_hz,
                           gpu_hi, dt)
        if lim.emc_locked:
            emc = clamp_to_limits(s.emc_hz, lim.emc_rate_hz, lim.emc_min_hz, lim.emc_max_hz)
        else:
            demand = w.mem_util * s.dram_bytes_per_s(prev.emc_hz)
            emc = emc_governor(s, demand, lim.emc_min_hz, lim.emc_max_hz, self.emc_idle_floor_hz)
        busy = PHASE_CPU_CORES[w.phase] if w.cpu_cores is None else w.cpu_cores
        cpu = []
        for i, n in enumerate(lim.cpu_online):
            util = min(1.0, busy / n) if n and i == 0 else 0.0
            cpu.append(cpu_governor(lim.cpu_governor[i], s.cpu_khz, util, lim.cpu_min_khz[i],
                                    cpu_hi[i]))
        gated = lim.railgate and self._rt.gpu_idle_s >= RAILGATE_DELAY_S
        return Clocks(gpu, emc, active_tpcs(s, lim.tpc_pg_mask), tuple(cpu), lim.cpu_online,
                      gpu_powered=not gated, cpu_idle_states=lim.cpu_idle_states)

    def step(self, dt_s: float, workload: Workload = IDLE) -> TwinState:
        """Advance the model by ``dt_s`` seconds of virtual time, in memory only."""
        if dt_s <= 0:
            return self.state
        st, s, rt = self.state, self.spec, self._rt
        w = workload
        if st.shutdown:
            w = IDLE
        rt.gpu_idle_s = rt.gpu_idle_s + dt_s if w.gpu_util == 0 else 0.0
        clocks = self._settle(dt_s, w, st.throttle_steps)
        if st.shutdown:
            clocks = replace(clocks, gpu_powered=False)
        # the bytes the work moves do not change with the clock: rescale the reported utilisation
        dram = w.mem_util * s.dram_bytes_per_s(st.clocks.emc_hz)
        emc_util = min(1.0, dram / s.dram_bytes_per_s(clocks.emc_hz))
        intensity = PHASE_INTENSITY[w.phase] if w.intensity is None else w.intensity
        busy = w.gpu_util if clocks.gpu_powered else 0.0
        act = Activity(busy, intensity, dram,
                       PHASE_CPU_CORES[w.phase] if w.cpu_cores is None else w.cpu_cores)
        pw = power(s, clocks, act)
        while pw.module_w > s.power.module_cap_w and clocks.gpu_hz > s.gpu_hz[0]:
            # over the module budget: the hardware's over-current throttle pulls the GPU down (estimate)
            clocks = replace(clocks, gpu_hz=snap(s.gpu_hz, clocks.gpu_hz - 1, up=False))
            pw = power(s, clocks, act)
        if st.shutdown:
            pw = replace(pw, gpu_w=0.0, cpu_w=0.0, soc_w=0.0, dram_w=0.0, sys_w=0.0,
                         rails=tuple((n, 0.0) for n, _ in pw.rails), board_w=0.0, module_w=0.0)
        fan = st.fan_pwm
        if not self.fan_daemon:
            fan = self.limits.fan_pwm
        else:
            rt.fan_acc_s += dt_s
            if rt.fan_acc_s >= FAN_POLL_S or st.t_s == 0.0:
                rt.fan_acc_s = 0.0
                fan = fan_curve(st.thermal.zones_c[-1])
        th = thermal_step(s, st.thermal, pw, self.ambient_c, fan, dt_s, ZONE_KINDS)
        throttle, shutdown = st.throttle_steps, st.shutdown
        rt.thermal_acc_s += dt_s
        if rt.thermal_acc_s >= THERMAL_POLL_S:
            polls = int(rt.thermal_acc_s / THERMAL_POLL_S)
            rt.thermal_acc_s -= polls * THERMAL_POLL_S
            hot = any(t * 1000 >= p for t, (p, _, _) in zip(th.zones_c, self.trips))
            cool = all(t * 1000 < p - h for t, (p, h, _) in zip(th.zones_c, self.trips))
            if hot:
                throttle = min(throttle + polls, len(s.gpu_hz) - 1)
            elif cool:          # between trip - hyst and trip: hold
                throttle = max(0, throttle - polls)
            if any(t * 1000 >= c for t, (_, _, c) in zip(th.zones_c, self.trips)) and not shutdown:
                log.error("twin: a zone crossed its critical trip at %.1f °C: the board shuts down",
                          max(th.zones_c))
                shutdown = True
        self.state = TwinState(st.t_s + dt_s, clocks, pw, th, st.zone_names, fan, busy, emc_util,
                               st.energy_j + pw.board_w * dt_s, throttle, shutdown)
        return self.state

    def advance(self, duration_s: float, workload: Workload = IDLE, max_dt_s: float = 1.0) -> TwinState:
        """``step`` repeatedly over ``duration_s`` in steps of at most ``max_dt_s``."""
        n = max(1, math.ceil(duration_s / max_dt_s))
        for _ in range(n):
            self.step(duration_s / n, workload)
        return self.state

    def fail_zone(self, kind: str) -> None:
        """Make a zone's ``temp`` unreadable (EISDIR on read), as a failing sensor would be."""
        i = ZONE_KINDS.index(kind)
        f = self.root / self.paths.zone(i) / "temp"
        if f.is_file():
            f.unlink()
        f.mkdir(exist_ok=True)
        self._rt.failed_zones.add(i)

    @property
    def written(self) -> frozenset[str]:
        """The reading files (relative to the root) the model has written so far."""
        return frozenset(self._rt.written)

    # --- writing the readings ---------------------------------------------------------------------

    def _put(self, rel: str, value: str) -> None:
        if self._rt.written.get(rel) == value or rel in self._rt.absent:
            return
        path = self.root / rel
        if rel not in self._rt.written and not path.is_file():
            # The kernel never creates a sysfs file: a reading someone removed (a failing sensor
            # played by a test) stays gone instead of coming back on the next flush.
            self._rt.absent.add(rel)
            return
        if self.atomic_writes:
            tmp = path.with_name(f".{path.name}.twin-tmp")
            tmp.write_text(value + "\n")
            os.replace(tmp, path)
        else:       # plain os calls: a flush writes ~40 files, Path.write_text is 2x slower
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, 0o644)
            try:
                os.write(fd, (value + "\n").encode())
            finally:
                os.close(fd)
        self._rt.written[rel] = value

    def flush(self) -> None:
        """Write the current readings into the tree (only files whose content changed)."""
        st, p, s = self.state, self.paths, self.spec
        c = st.clocks
        self._put(f"{p.gpu_devfreq}/cur_freq", str(c.gpu_hz))
        self._put(f"{p.gpu_devfreq}/target_freq", str(c.gpu_hz))
        for load in p.gpu_loads:
            self._put(load, str(round(st.gpu_load * 1000)))
        if not self.limits.emc_locked or self.limits.emc_rate_hz != c.emc_hz:
            self._put(f"{p.emc}/rate", str(c.emc_hz))     # bpmp reports the actual rate
        self._put(p.actmon, str(round(st.emc_util * c.emc_hz / 1000)))
        for cluster, khz in zip(s.cpu_clusters, c.cpu_khz):
            self._put(f"{p.policy(cluster[0])}/scaling_cur_freq", str(khz))
            self._put(f"{p.policy(cluster[0])}/cpuinfo_cur_freq", str(khz))
        for i, t in enumerate(st.thermal.zones_c):
            if i not in self._rt.failed_zones:
                self._put(f"{p.zone(i)}/temp", str(round(t * 1000)))        # m°C
        watts = dict(st.power.rails)
        for addr, hw in p.ina:
            shunt_sum, curr_sum = 0, 0
            for r in (r for r in s.rails if r.address == addr):
                n, w = r.channel, watts.get(r.label, 0.0)
                ma = round(w * 1e6 / r.bus_mv) if r.bus_mv else 0
                mv = r.bus_mv - ma * 2 // 1000 if r.bus_mv else 0     # a little load-line droop
                shunt = round(ma * r.shunt_uohm / 1e6)                 # mA x µOhm -> mV
                self._put(f"{hw}/in{n}_input", str(mv))
                self._put(f"{hw}/curr{n}_input", str(ma))
                self._put(f"{hw}/in{n + 3}_input", str(shunt))
                if r.label not in ("NC", "VIN_SYS_5V0"):    # VIN_SYS_5V0 has summation disabled
                    shunt_sum, curr_sum = shunt_sum + shunt, curr_sum + ma
            self._put(f"{hw}/in7_input", str(shunt_sum))
            self._put(f"{hw}/curr4_input", str(curr_sum))
        if self.fan_daemon:
            self._put(f"{p.fan_hwmon}/pwm1", str(st.fan_pwm))

    # --- real time --------------------------------------------------------------------------------

    def run(self, period_s: float = 0.1, duration_s: float | None = None,
            on_tick: Callable[[TwinState], None] | None = None) -> TwinState:
        """Real time: every ``period_s`` read limits and the workload file, step, flush. Returns
        after ``duration_s`` (forever if ``None``; stop it with Ctrl-C / KeyboardInterrupt)."""
        start = last = time.monotonic()
        workload = IDLE
        while True:
            now = time.monotonic()
            self.read_limits()
            workload = self.read_workload() or workload
            self.step(now - last if now > last else period_s, workload)
            self.flush()
            if on_tick is not None:
                on_tick(self.state)
            last = now
            if duration_s is not None and now - start >= duration_s:
                return self.state
            time.sleep(max(0.0, period_s - (time.monotonic() - now)))
