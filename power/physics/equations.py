"""The board's equations: the workload it runs, rail power from clocks and activity, the RC thermal
model, and the clock governors (podgov, schedutil, the EMC bandwidth manager, nvfancontrol) as pure
functions.

Shared by the twin (power.twin.model) and the cost model (power.physics.costmodel). No I/O, no clock reads: every
function takes what it needs and returns a value, so the same code serves the twin in real time, the
twin in virtual time and the cost model. Constants live in ``power.physics.boards`` with their sources.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from power.physics.boards import BoardSpec
from power.hw.tables import snap

PHASES = ("prefill", "decode", "idle")


@dataclass(frozen=True)
class Workload:
    """What the engine is doing, as the engine reports it in ``<root>/run/orin-agent-twin/workload.json``.

    ``gpu_util``: fraction of time the GPU is busy at the current clocks (0..1). ``mem_util``:
    fraction of the DRAM bandwidth *at the current EMC rate* the work uses (0..1), as actmon would
    report it. ``cpu_cores``: cores' worth of busy CPU (default by phase). ``intensity``: switching
    activity relative to a GPU stress test (default by phase, see PHASE_INTENSITY).
    """
    phase: str = "idle"
    gpu_util: float = 0.0
    mem_util: float = 0.0
    cpu_cores: float | None = None
    intensity: float | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"workload phase {self.phase!r}: must be one of {', '.join(PHASES)}")
        for name in ("gpu_util", "mem_util"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"workload {name}={v}: must be within 0..1")

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        d = json.loads(text)
        return cls(phase=str(d.get("phase", "idle")), gpu_util=float(d.get("gpu_util", 0.0)),
                   mem_util=float(d.get("mem_util", 0.0)),
                   cpu_cores=None if d.get("cpu_cores") is None else float(d["cpu_cores"]),
                   intensity=None if d.get("intensity") is None else float(d["intensity"]))

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})


IDLE = Workload()


# --- clocks and activity ----------------------------------------------------------------------


@dataclass(frozen=True)
class Clocks:
    """The clocks in force. ``cpu_khz`` and ``cpu_online`` are per cluster."""
    gpu_hz: int
    emc_hz: int
    tpcs: int
    cpu_khz: tuple[int, ...]
    cpu_online: tuple[int, ...]
    gpu_powered: bool = True
    cpu_idle_states: bool = True    # False after jetson_clocks: idle cores spin instead of entering c7


@dataclass(frozen=True)
class Activity:
    """What the hardware is doing over an interval."""
    gpu_busy: float             # fraction of time the GPU runs work (0..1)
    gpu_intensity: float        # switching activity of the work relative to a GPU stress test
    dram_bytes_per_s: float
    cpu_busy_cores: float       # cores' worth of busy CPU time


# Switching activity of each phase relative to the stress test the GPU-rail fit comes from.
# Estimates: prefill runs tensor-core GEMMs near stress level; decode at batch 1 mostly waits on
# DRAM, and 0.2 puts AGX decode of an 8B model at ~25 W board power, inside the 22-27 W EdgeReasoning
# measured (arXiv 2511.01866, vLLM FP16 on AGX Orin 64GB, ORIN.md).
PHASE_INTENSITY = {"prefill": 0.85, "decode": 0.2, "idle": 0.0}
# CPU cores' worth busy per phase (estimate: one engine thread drives the GPU).
PHASE_CPU_CORES = {"prefill": 1.0, "decode": 1.0, "idle": 0.05}


@dataclass(frozen=True)
class Power:
    """Power by component and by INA3221 rail label, in watts."""
    gpu_w: float
    cpu_w: float
    soc_w: float
    dram_w: float
    sys_w: float
    rails: tuple[tuple[str, float], ...]
    board_w: float              # what the rails add up to (AGX: sum of rails; NX/Nano: VDD_IN)
    module_w: float             # heat into the module's heatsink; compared to the module cap


def power(spec: BoardSpec, c: Clocks, a: Activity) -> Power:
    """Rail power at the given clocks and activity (equations fitted in ``board_specs``)."""
    k = spec.power
    gpu = 0.0
    if c.gpu_powered:
        f = c.gpu_hz / k.gpu_ref_hz
        # leakage grows with the voltage the clock needs (~linear in f over the table: estimate),
        # so a GPU pinned at its top clock costs more at idle than one podgov let drop
        gpu = c.tpcs * (k.gpu_leak_w_per_tpc * (0.5 + 0.5 * f)
                        + k.gpu_w_per_tpc * a.gpu_busy * a.gpu_intensity * f ** k.gpu_exp)
    online = sum(c.cpu_online)
    cpu = k.cpu_floor_w * online / spec.cpu_count
    busy = a.cpu_busy_cores
    for khz, n in zip(c.cpu_khz, c.cpu_online):     # busy time lands on the first online clusters
        use = min(busy, n) if n and busy > 0 else 0.0
        cpu += k.cpu_w_per_core * use * (khz / k.cpu_ref_khz) ** k.cpu_exp
        busy -= use
        if not c.cpu_idle_states:                   # the idle cores cannot sleep (jetson_clocks)
            cpu += k.cpu_noidle_w_per_core * (n - use) * (khz / k.cpu_ref_khz) ** k.cpu_exp
    soc = k.soc_base_w + k.soc_emc_w * c.emc_hz / spec.emc_max_hz
    dram = k.dram_j_per_byte * a.dram_bytes_per_s
    dram_soc = dram * k.dram_share_on_soc
    dram_io = k.dram_idle_w + dram - dram_soc
    if spec.rails[0].label == "VDD_GPU_SOC":        # AGX Orin: four measured rails
        rails = (("VDD_GPU_SOC", gpu + soc + dram_soc), ("VDD_CPU_CV", cpu),
                 ("VIN_SYS_5V0", k.sys_w), ("VDDQ_VDD2_1V8AO", dram_io))
        board = sum(w for _, w in rails)
        module = board - k.sys_w                    # VIN_SYS_5V0 feeds the carrier
    else:                                           # Orin NX / Nano: VDD_IN is the module total
        board = gpu + cpu + soc + dram + k.sys_w + k.dram_idle_w
        rails = (("VDD_IN", board), ("VDD_CPU_GPU_CV", gpu + cpu), ("VDD_SOC", soc + dram_soc))
        module = board
    return Power(gpu, cpu, soc, dram, k.sys_w, rails, board, module)


# --- thermal ----------------------------------------------------------------------------------

# Per-zone hot spot above the die average, °C per watt of the zone's own block (estimates: sensors
# near a busy block read a few degrees above the rest; tj reports the hottest zone).
_ZONE_LOCAL = {"cpu": ("cpu", 0.35), "gpu": ("gpu", 0.25), "cv0": ("cpu", 0.05),
               "cv1": ("cpu", 0.05), "cv2": ("cpu", 0.05), "soc0": ("soc", 0.4),
               "soc1": ("soc", 0.3), "soc2": ("soc", 0.3)}


@dataclass(frozen=True)
class Temperatures:
    sink_c: float
    zones_c: tuple[float, ...]      # in ZONE_KINDS order (tj last)


def fan_resistance(spec: BoardSpec, pwm: int) -> float:
    """Heatsink-to-ambient resistance: conductances of still air and of the fan add (estimate)."""
    t = spec.thermal
    g = 1 / t.r_fan_off + (max(0, min(255, pwm)) / 255) * (1 / t.r_fan_full - 1 / t.r_fan_off)
    return 1 / g


def thermal_step(spec: BoardSpec, th: Temperatures, p: Power, ambient_c: float, pwm: int,
                 dt: float, kinds: tuple[str, ...]) -> Temperatures:
    """Advance the RC model by ``dt`` with the exact exponential solution (stable at any dt)."""
    r = fan_resistance(spec, pwm)
    tau = r * spec.thermal.c_sink
    sink_ss = ambient_c + p.module_w * r
    sink = sink_ss + (th.sink_c - sink_ss) * math.exp(-dt / tau)
    die = sink + spec.thermal.r_die * p.module_w
    a = 1 - math.exp(-dt / spec.thermal.tau_die_s)
    block = {"cpu": p.cpu_w, "gpu": p.gpu_w, "soc": p.soc_w + p.dram_w}
    zones = []
    for kind, old in zip(kinds[:-1], th.zones_c[:-1]):
        src, k = _ZONE_LOCAL[kind]
        ss = die + k * block[src]
        zones.append(old + (ss - old) * a)
    zones.append(max(zones))                        # tj: the hottest junction
    return Temperatures(sink, tuple(zones))


# --- governors ---------------------------------------------------------------------------------

def clamp_to_limits(table: tuple[int, ...], f: float, lo: float, hi: float) -> int:
    """devfreq/cpufreq: the effective range is [snap_up(min), snap_down(max)]; max wins over min."""
    top = snap(table, up=False, want=hi)
    bottom = min(snap(table, up=True, want=lo), top)
    return snap(table, up=False, want=min(max(f, bottom), top))


PODGOV_TARGET_LOAD = 0.7        # estimate: podgov scales to keep the GPU ~70 % busy
PODGOV_SAMPLE_S = 0.05          # estimate: podgov re-evaluates every ~50 ms


def podgov(table: tuple[int, ...], cur: int, busy: float, lo: int, hi: int, dt: float) -> int:
    """nvhost_podgov-like: work = busy x cur; scale to work / target load. A saturated GPU
    (busy ~1) hides its real demand, so the clock climbs by 1/target per sample until it is not."""
    if busy >= 0.98:
        samples = max(1, int(dt / PODGOV_SAMPLE_S))
        want = cur * (1 / PODGOV_TARGET_LOAD) ** min(samples, 40)
        return clamp_to_limits(table, snap(table, up=True, want=want), lo, hi)
    return clamp_to_limits(table, snap(table, up=True, want=busy * cur / PODGOV_TARGET_LOAD), lo, hi)


def gpu_governor(governor: str, table: tuple[int, ...], cur: int, busy: float, lo: int, hi: int,
                 dt: float) -> int:
    if governor == "performance":
        return clamp_to_limits(table, table[-1], lo, hi)
    if governor == "powersave":
        return clamp_to_limits(table, table[0], lo, hi)
    if governor == "userspace":
        return clamp_to_limits(table, cur, lo, hi)
    return podgov(table, cur, busy, lo, hi, dt)     # nvhost_podgov and anything unknown


SCHEDUTIL_MARGIN = 1.25         # schedutil's headroom: f = 1.25 x util x max (kernel source)


def cpu_governor(governor: str, table: tuple[int, ...], util: float, lo: int, hi: int) -> int:
    if governor == "performance":
        return clamp_to_limits(table, table[-1], lo, hi)
    if governor == "powersave":
        return clamp_to_limits(table, table[0], lo, hi)
    return clamp_to_limits(table, snap(table, up=True, want=SCHEDUTIL_MARGIN * util * table[-1]), lo, hi)


EMC_TARGET_UTIL = 0.7           # estimate: the bandwidth manager keeps DRAM below ~70 % busy
EMC_IDLE_FLOOR_HZ = 2133000000  # captured: idle Orin boards report EMC at 2133 MHz in tegrastats


def emc_governor(spec: BoardSpec, demand_bytes_per_s: float, lo: int, hi: int,
                 idle_floor_hz: int = EMC_IDLE_FLOOR_HZ) -> int:
    """Unlocked EMC: the lowest rate at or above the idle floor that serves the demand at the target
    utilisation."""
    table = spec.emc_hz
    floor = snap(table, up=False, want=idle_floor_hz)
    for f in table:
        if f >= floor and spec.dram_bytes_per_s(f) * EMC_TARGET_UTIL >= demand_bytes_per_s:
            return clamp_to_limits(table, f, lo, hi)
    return clamp_to_limits(table, table[-1], lo, hi)


# nvfancontrol "cool" profile (default): (°C, PWM) points, linear between them. NVIDIA Jetson Linux
# r34.1 nvfancontrol documentation (ORIN.md).
FAN_CURVE_COOL = ((0.0, 0), (45.0, 88), (60.0, 149), (75.0, 202), (87.0, 255))
FAN_POLL_S = 2.0                # nvfancontrol polls every 2 s (same documentation)


def fan_curve(temp_c: float, curve: tuple[tuple[float, int], ...] = FAN_CURVE_COOL) -> int:
    if temp_c <= curve[0][0]:
        return curve[0][1]
    for (t0, p0), (t1, p1) in zip(curve, curve[1:]):
        if temp_c <= t1:
            return round(p0 + (p1 - p0) * (temp_c - t0) / (t1 - t0))
    return curve[-1][1]
