"""Board specifications of the Jetson Orin family: clock tables, power modes, rails, bandwidth,
compute and the power/thermal constants the twin and the cost model are built on.

Shared by the controller, the cost model and the twin. Pure data, no I/O.
Readers of a real board never trust these numbers: they read ``available_frequencies`` and
``nvpmodel.conf`` from the device (see ../shared/ORIN.md). Every constant says where it comes from:
*published* (a datasheet, NVIDIA's file or a paper), *captured* (read off a real board in a public
script or log), *derived* (computed from published figures) or *estimate* (no public figure).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# --- clock tables ------------------------------------------------------------------------------

# AGX Orin GPU devfreq `available_frequencies` (Hz), captured: the list a public AGX Orin DVFS sweep
# script reads off L4T r35 (114.75 MHz + n x 102 MHz up to 1236.75, then 1300.5 MHz).
_AGX_GPU_HZ = (114750000, 216750000, 318750000, 420750000, 522750000, 624750000, 726750000,
               828750000, 930750000, 1032750000, 1134750000, 1236750000, 1300500000)
# Orin NX 16GB GPU table, captured (a public NX benchmark script's comment lists the node's table).
_NX_GPU_HZ = (306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000)
# Orin Nano 8GB, original (JetPack 5): 306/510/624.75 MHz captured in a public sweep; 408 MHz is
# inferred from the NX table (same 102 MHz grid).
_NANO_GPU_HZ = (306000000, 408000000, 510000000, 624750000)
# Orin Nano 8GB "Super" (JetPack 6.2): captured, a public r36 sweep over 306..1020 MHz.
_NANO_SUPER_GPU_HZ = (306000000, 408000000, 510000000, 612000000, 714000000, 816000000,
                      918000000, 1020000000)

# EMC (LPDDR5) rates in Hz, captured: 204 / 665.6 / 2133 / 3199 MHz are the points a public AGX Orin
# sweep and a public Orin Nano Super EMC study lock through bpmp debugfs.
_EMC_HZ = (204000000, 665600000, 2133000000, 3199000000)
_EMC_HZ_NANO = (204000000, 665600000, 2133000000)   # 68 GB/s = 2133 MHz x 2 x 128 bit: derived


def _cpu_table(top_khz: int, last_grid_khz: int) -> tuple[int, ...]:
    """Orin's A78AE cpufreq table: 115.2 MHz + n x 76.8 MHz, then the SKU's top frequency.

    Captured on Orin NX (115200 ... 1958400 1984000); the same grid gives every nvpmodel CPU cap
    in NVIDIA's files (1113600, 1497600, 1728000), so AGX and Nano tables are built on it.
    """
    grid = tuple(range(115200, last_grid_khz + 1, 76800))
    return grid if grid[-1] == top_khz else grid + (top_khz,)


# --- specs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModeSpec:
    """One nvpmodel POWER_MODEL block. ``None`` = no cap (-1 in the file; EMC may be written 0)."""
    id: int
    name: str
    online_cores: int
    cpu_max_khz: int | None
    gpu_max_hz: int | None
    tpc_pg_mask: int
    emc_cap_hz: int | None
    emc_cap_as_zero: bool = False       # NVIDIA's newer files write EMC "no cap" as 0, older as -1
    dla_core_hz: int | None = None      # DLA/PVA caps, written only where the board has them
    dla_falcon_hz: int | None = None
    pva_vps_hz: int | None = None
    pva_axi_hz: int | None = None


@dataclass(frozen=True)
class RailSpec:
    """One INA3221 channel: the label the kernel shows and the bus voltage it sits on."""
    address: str            # "1-0040"
    channel: int            # 1..3
    label: str              # "VDD_GPU_SOC", or "NC" for an unconnected channel
    bus_mv: int             # nominal bus voltage (the INA3221 reads the rail's input side)
    shunt_uohm: int         # shunt resistor, published in the upstream device tree
    crit_ma: int            # currN_crit: estimate (a value near the rail's budget)


@dataclass(frozen=True)
class PowerConstants:
    """The twin's power model (see power/physics/equations.py for the equations)."""
    gpu_w_per_tpc: float        # dynamic GPU power per TPC at ref clock, full activity
    gpu_ref_hz: int             # reference clock of the fit
    gpu_exp: float              # dynamic power ~ f^gpu_exp along the V-f curve
    gpu_leak_w_per_tpc: float   # leakage of a powered (not rail-gated) TPC
    cpu_w_per_core: float       # dynamic CPU power per busy core at cpu_ref_khz
    cpu_ref_khz: int
    cpu_exp: float
    cpu_floor_w: float          # CPU rail with every core online and idle (idle states enabled)
    cpu_noidle_w_per_core: float  # an idle online core whose idle states are disabled, at cpu_ref_khz
    soc_base_w: float           # SOC fabric etc. with EMC at its lowest rate
    soc_emc_w: float            # extra SOC power with EMC at its top rate (linear in rate)
    dram_j_per_byte: float      # DRAM streaming energy
    dram_share_on_soc: float    # the part of it seen on the SOC rail (rest: DRAM/other rail)
    sys_w: float                # carrier / IO rail (AGX VIN_SYS_5V0) or module remainder (NX/Nano)
    dram_idle_w: float          # DRAM IO rail at idle (AGX VDDQ_VDD2_1V8AO; 0 where not measured)
    module_cap_w: float         # module power budget; the twin throttles the GPU above it


@dataclass(frozen=True)
class ThermalConstants:
    """Lumped RC: one heatsink node (slow) plus a fast die offset per zone."""
    r_fan_off: float        # heatsink to ambient, fan stopped (°C/W)
    r_fan_full: float       # same at PWM 255 (°C/W)
    c_sink: float           # heat capacity of the heatsink node (J/°C)
    tau_die_s: float        # die-above-heatsink time constant
    r_die: float            # die above heatsink per watt of board power (°C/W)


@dataclass(frozen=True)
class BoardSpec:
    name: str
    module: str                         # "p3701-0005"
    model: str                          # /proc/device-tree/model
    compatible: tuple[str, ...]         # /proc/device-tree/compatible, NUL-separated in the file
    gpu_cores: int
    tpcs: int                           # TPCs the SKU has (T234 silicon: 8)
    gpu_hz: tuple[int, ...]
    emc_hz: tuple[int, ...]
    dram_bus_bits: int
    memory_gb: int
    cpu_clusters: tuple[tuple[int, ...], ...]
    cpu_khz: tuple[int, ...]
    modes: tuple[ModeSpec, ...]
    default_mode: int
    rails: tuple[RailSpec, ...]
    power: PowerConstants
    thermal: ThermalConstants
    has_dla: bool = True
    conf_name: str = ""                 # NVIDIA's file name for this module's nvpmodel.conf

    @property
    def cpu_count(self) -> int:
        return sum(len(c) for c in self.cpu_clusters)

    @property
    def gpu_max_hz(self) -> int:
        return self.gpu_hz[-1]

    @property
    def emc_max_hz(self) -> int:
        return self.emc_hz[-1]

    def dram_bytes_per_s(self, emc_hz: float) -> float:
        """Peak DRAM bandwidth at an EMC rate: rate x 2 (DDR) x bus width. 3199 MHz x 2 x 256 bit
        = 204.7 GB/s on AGX, the published 204.8 GB/s."""
        return emc_hz * 2 * self.dram_bus_bits / 8

    def mode(self, mode_id: int) -> ModeSpec:
        for m in self.modes:
            if m.id == mode_id:
                return m
        raise KeyError(f"{self.name} has no power mode {mode_id}")


# --- constants shared by every T234 board (same silicon) ---------------------------------------

# GPU rail fit, derived from the forum measurement in ORIN.md (VDD_GPU_SOC under GPU stress: MAXN
# 40.4 W @1300.5 MHz/8 TPC, 50W 18.4 W @828.75/8, 30W 7.6 W @624.75/4, 15W 5.2 W @420.75/3):
# P = 4 W floor + 4.55 W/TPC x (f/1300.5 MHz)^2.06 reproduces all four within 5 % as a fit of its own
# (the 2.06 sits in ORIN.md's 2.0-2.3 "dynamic part" range). The 4 W floor is split below into SOC base +
# EMC + GPU leakage, which scale with the mode's EMC cap, TPCs and clock: with that split the twin reads the
# four points at +2.3 / +3.0 / +1.0 / -18.4 % (MAXN / 50W / 30W / 15W; docs/TWIN_VALIDATION.md rows 15-18).
_GPU_W_PER_TPC = 36.4 / 8
_GPU_EXP = 2.06
# CPU rail fit, derived from VDD_CPU_CV under CPU stress (MAXN 15.2 W: 12 cores @2201.6 MHz, 50W
# 6.0 W: 12 @1497.6, 30W 5.6 W: 8 @1728, 15W 1.6 W: 4 @1113.6): 0.6 W floor + 1.217 W/core x
# (f/2201.6 MHz)^2.58 is within 0.2 W of each as a fit of its own. The twin's floor is the captured idle
# 0.40 W (below), scaled by the cores online, so it reads the four at -1.3 / -3.3 / -2.2 / -39.3 %
# (TWIN_VALIDATION rows 19-22: at 15W, 4 cores at 1.1 GHz, the fit's 0.6 W floor was most of the rail).
_CPU_W_PER_CORE = 14.6 / 12
_CPU_EXP = 2.58
# DRAM streaming: +3.7 W on the Orin Nano SOC rail (community measurement, ORIN.md) while streaming
# near its 68 GB/s peak: 3.7 / 68e9 = 54 pJ/byte (derived; assumes the test ran near peak).
_DRAM_J_PER_BYTE = 3.7 / 68e9

# Idle rails, captured with tegrastats on AGX Orin 64GB dev kits (public):
# - default governors, MAXN, GPU rail-gated, EMC 2133 MHz, CPUs idle at 729.6 MHz: VDD_GPU_SOC 2399 mW,
#   VDD_CPU_CV 400 mW, VIN_SYS_5V0 4032 mW, VDDQ_VDD2_1V8AO 301 mW (7.1 W total; catid's blog post
#   "Jetson Orin", 2023-04-23, catid.io/posts/orin_opt, with its `jetson_clocks --show`: IdleStates WFI=1 c7=1);
# - every core pinned at 2201.6 MHz at 0 % load (the jetson_clocks state; the EMC is not printed): VDD_GPU_SOC
#   4940 mW, VDD_CPU_CV 988 mW, VIN_SYS_5V0 4442 mW (DataDog/datadog-agent,
#   pkg/collector/corechecks/nvidia/jetson/jetson_test.go, `orinSample`);
# - r36, two cores busy at 2201.6 MHz: VIN_SYS_5V0 4767 mW (same file, `r36Sample`).
# Derived from them: the rail-gated idle gives SOC base + soc_emc x 2133/3199 = 2.40 W; the pinned idle gives
# base + soc_emc + powered-GPU leakage at the top clock = 4.94 W. How the 2.54 W left splits between the EMC
# rate and GPU leakage is not measured: soc_emc 1.5 W (base 1.40 W, leakage 0.255 W per TPC at the top clock)
# puts the GPU-stress points at +2.3 / +3.0 / +1.0 / -18.4 % (MAXN / 50W / 30W / 15W: TWIN_VALIDATION rows
# 15-18; the 15W mode's 3 TPCs keep little leakage, and a V-f curve that flattens at its bottom would explain
# the rest); 1.0-2.5 W fit about as well (mean error 4.2-3.4 % over the four), and nothing public splits the 2.54 W, so
# soc_emc_w is a choice inside that range: the energy bench's sampled boards (power.bench.truth) draw it from
# 1.0-2.5 W. An idle core with its idle states disabled (jetson_clocks) at 2.2 GHz: (0.988 - 0.400 - 0.06 W)
# / 12 = 0.044 W, where the 0.06 W is the twin's own idle background load (equations.PHASE_CPU_CORES: 0.05
# of a core busy at 2.2 GHz, 0.05 x 1.217 W), which the pinned capture includes. VIN_SYS_5V0: the median of
# the three captures (4.03 / 4.44 / 4.77 W).
_AGX_POWER = PowerConstants(
    gpu_w_per_tpc=_GPU_W_PER_TPC, gpu_ref_hz=1300500000, gpu_exp=_GPU_EXP,
    gpu_leak_w_per_tpc=0.255,       # derived from the captures above
    cpu_w_per_core=_CPU_W_PER_CORE, cpu_ref_khz=2201600, cpu_exp=_CPU_EXP,
    cpu_floor_w=0.4,                # captured: VDD_CPU_CV 400 mW, 12 cores online and idle
    cpu_noidle_w_per_core=0.044,    # derived from the captures above
    soc_base_w=1.40, soc_emc_w=1.5,  # derived from the captures above (the EMC share: see there)
    dram_j_per_byte=_DRAM_J_PER_BYTE,
    dram_share_on_soc=0.7,          # estimate: controller on VDD_GPU_SOC, IO on VDDQ_VDD2_1V8AO
    sys_w=4.44,                     # captured: VIN_SYS_5V0 4.03 / 4.44 / 4.77 W (median)
    dram_idle_w=0.3,                # captured: VDDQ_VDD2_1V8AO 301 mW on an idle AGX
    module_cap_w=60.0,              # published: AGX Orin 64GB module maximum (ORIN.md)
)
# AGX thermal: no source (no public AGX Orin heatsink figure), an estimate. No energy goal depends on it:
# the chat bench at 25 °C peaks ~48 W for seconds and never comes near a trip. Sized so that ~50 W sustained
# at 45 °C ambient reaches the 99 °C throttle trip with the fan at full, and ~25 W decode at 25 °C sits near 55 °C.
_AGX_THERMAL = ThermalConstants(r_fan_off=2.0, r_fan_full=0.9, c_sink=330.0, tau_die_s=3.0,
                                r_die=0.12)
# Orin NX/Nano devkit heatsink: fan off 6.2 °C/W, tau 6.6 min (community measurement on Nano) ->
# C = 396 s / 6.2 = 64 J/°C; fan full "about 10 min to settle" = ~3 tau -> tau 200 s -> 3.1 °C/W
# (derived). NX uses the same numbers (estimate: same devkit heatsink).
_P3767_THERMAL = ThermalConstants(r_fan_off=6.2, r_fan_full=3.1, c_sink=64.0, tau_die_s=3.0,
                                  r_die=0.3)


def _p3767_power(cap_w: float) -> PowerConstants:
    # Same silicon as AGX, so the same per-TPC and per-core curves (derived). The base values are
    # estimates: no public idle Orin Nano capture was found (a test fixture's "Orin Nano" line is written from
    # memory, it says); the nearest public capture is an idle Orin NX 16GB (DataDog/datadog-agent
    # jetson_test.go voltageUnitSample: VDD_IN 5.30 W, VDD_CPU_GPU_CV 0.77 W, VDD_SOC 1.42 W at EMC 2133 MHz,
    # 4 of 8 cores online), whose SOC rail these sit near; the Nano's own figures are unmeasured.
    return PowerConstants(
        gpu_w_per_tpc=_GPU_W_PER_TPC, gpu_ref_hz=1300500000, gpu_exp=_GPU_EXP,
        gpu_leak_w_per_tpc=0.1, cpu_w_per_core=_CPU_W_PER_CORE, cpu_ref_khz=2201600,
        cpu_exp=_CPU_EXP, cpu_floor_w=0.5, cpu_noidle_w_per_core=0.044, soc_base_w=1.0, soc_emc_w=0.4,
        dram_j_per_byte=_DRAM_J_PER_BYTE, dram_share_on_soc=1.0,   # the 3.7 W showed on VDD_SOC
        sys_w=1.9, dram_idle_w=0.0, module_cap_w=cap_w)


# --- power modes (NVIDIA's nvpmodel files; ORIN.md's AGX table) -------------------------------

_AGX64_MODES = (
    ModeSpec(0, "MAXN", 12, None, None, 0, None, True),
    ModeSpec(1, "MODE_15W", 4, 1113600, 420750000, 248, 2133000000, False,
              614400000, 294400000, 307200000, 217600000),
    ModeSpec(2, "MODE_30W", 8, 1728000, 624750000, 240, None, True,
              1369600000, 729600000, 512000000, 358400000),
    ModeSpec(3, "MODE_50W", 12, 1497600, 828750000, 0, None, True,
              1369600000, 729600000, 704000000, 486400000),
)
# AGX 32GB (nvpmodel_p3701_0004.conf). NVIDIA's file caps the GPU at 408/612/816 MHz, points of the
# older 102 MHz grid; this twin's 32GB table uses the 64GB grid, so the caps are its nearest points
# 420.75/624.75/828.75 MHz (the same values ORIN.md gives for the 64GB modes).
_AGX32_MODES = (
    ModeSpec(0, "MAXN", 8, None, None, 128, None),
    ModeSpec(1, "MODE_15W", 4, 1113600, 420750000, 248, 2133000000, False,
              614400000, 294400000, 307200000, 217600000),
    ModeSpec(2, "MODE_30W", 8, 1728000, 624750000, 240, None, False,
              1369600000, 729600000, 512000000, 358400000),
    ModeSpec(3, "MODE_40W", 8, 1497600, 828750000, 128, None, False,
              1228800000, 652800000, 704000000, 486400000),
)
# Orin NX 16GB (nvpmodel_p3767_0000.conf). Its 25W mode really caps the GPU at 408 MHz (CPU-heavy).
_NX16_MODES = (
    ModeSpec(0, "MAXN", 8, None, None, 240, None, True),
    ModeSpec(1, "10W", 4, 1190400, 612000000, 252, 2133000000, False,
              153600000, 115000000, 115000000, 115000000),
    ModeSpec(2, "15W", 4, 1651200, 612000000, 252, None, True,
              614400000, 294400000, 115000000, 115000000),
    ModeSpec(3, "25W", 8, 1497600, 408000000, 240, None, True,
              614400000, 294400000, 512000000, 358400000),
)
# Orin Nano 8GB, JetPack 5 (nvpmodel_p3767_0003.conf) and JetPack 6.2 "Super"
# (nvpmodel_p3767_0003_super.conf).
_NANO_MODES = (
    ModeSpec(0, "15W", 6, None, None, 240, None, True),
    ModeSpec(1, "7W", 4, 960000, 408000000, 252, 2133000000),
)
_NANO_SUPER_MODES = (
    ModeSpec(0, "15W", 6, 1497600, 612000000, 240, 2133000000),
    ModeSpec(1, "25W", 6, 1344000, 918000000, 240, 3199000000),
    ModeSpec(2, "MAXN_SUPER", 6, None, None, 240, None),
)

# --- rails (upstream tegra234-p3701.dtsi / tegra234-p3767.dtsi INA3221 nodes) -------------------
# AGX: 1-0040 VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0; 1-0041 in2 VDDQ_VDD2_1V8AO, in1/in3 disabled
# (L4T labels them "NC"). Shunts 2 mOhm (published DT). Bus voltages: a captured AGX INA3221 reads
# ~18.8 V on the GPU/CPU channels (module input side) and ~4.97 V on the 5 V channels.
_AGX_RAILS = (
    RailSpec("1-0040", 1, "VDD_GPU_SOC", 19000, 2000, 5000),
    RailSpec("1-0040", 2, "VDD_CPU_CV", 19000, 2000, 3000),
    RailSpec("1-0040", 3, "VIN_SYS_5V0", 4968, 2000, 4000),
    RailSpec("1-0041", 1, "NC", 0, 2000, 0),
    RailSpec("1-0041", 2, "VDDQ_VDD2_1V8AO", 4968, 2000, 2000),
    RailSpec("1-0041", 3, "NC", 0, 2000, 0),
)
# NX/Nano: 1-0040 VDD_IN (module total), VDD_CPU_GPU_CV, VDD_SOC; shunts 5 mOhm (published DT);
# ~4.98 V bus (captured).
_P3767_RAILS = (
    RailSpec("1-0040", 1, "VDD_IN", 4984, 5000, 6000),
    RailSpec("1-0040", 2, "VDD_CPU_GPU_CV", 4976, 5000, 4000),
    RailSpec("1-0040", 3, "VDD_SOC", 4976, 5000, 3000),
)

_AGX_CLUSTERS = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
_OCTO_CLUSTERS = ((0, 1, 2, 3), (4, 5, 6, 7))
_HEXA_CLUSTERS = ((0, 1, 2, 3), (4, 5))


def _board(name: str, module: str, model: str, carrier: str, **kw: object) -> BoardSpec:
    compatible = (f"nvidia,{carrier}+{module}", f"nvidia,{module}", "nvidia,tegra234")
    return BoardSpec(name=name, module=module, model=model, compatible=compatible, **kw)  # type: ignore[arg-type]


BOARDS: dict[str, BoardSpec] = {
    "agx-orin-64gb": _board(
        "agx-orin-64gb", "p3701-0005", "NVIDIA Jetson AGX Orin Developer Kit", "p3737-0000",
        gpu_cores=2048, tpcs=8, gpu_hz=_AGX_GPU_HZ, emc_hz=_EMC_HZ, dram_bus_bits=256,
        memory_gb=64, cpu_clusters=_AGX_CLUSTERS, cpu_khz=_cpu_table(2201600, 2188800),
        modes=_AGX64_MODES, default_mode=2, rails=_AGX_RAILS, power=_AGX_POWER,
        thermal=_AGX_THERMAL, conf_name="nvpmodel_p3701_0000.conf"),
    "agx-orin-32gb": _board(
        "agx-orin-32gb", "p3701-0004", "NVIDIA Jetson AGX Orin", "p3737-0000",
        gpu_cores=1792, tpcs=7, gpu_hz=_AGX_GPU_HZ[:9], emc_hz=_EMC_HZ, dram_bus_bits=256,
        memory_gb=32, cpu_clusters=_OCTO_CLUSTERS, cpu_khz=_cpu_table(2201600, 2188800),
        modes=_AGX32_MODES, default_mode=2, rails=_AGX_RAILS,
        # published: AGX Orin 32GB module maximum 40 W (ORIN.md)
        power=replace(_AGX_POWER, module_cap_w=40.0),
        thermal=_AGX_THERMAL, conf_name="nvpmodel_p3701_0004.conf"),
    "orin-nx-16gb": _board(
        "orin-nx-16gb", "p3767-0000", "NVIDIA Orin NX Developer Kit", "p3768-0000",
        gpu_cores=1024, tpcs=4, gpu_hz=_NX_GPU_HZ, emc_hz=_EMC_HZ, dram_bus_bits=128,
        memory_gb=16, cpu_clusters=_OCTO_CLUSTERS, cpu_khz=_cpu_table(1984000, 1958400),
        modes=_NX16_MODES, default_mode=2, rails=_P3767_RAILS,
        power=_p3767_power(25.0),          # estimate: the highest named mode
        thermal=_P3767_THERMAL, conf_name="nvpmodel_p3767_0000.conf"),
    "orin-nano-8gb": _board(
        "orin-nano-8gb", "p3767-0003", "NVIDIA Jetson Orin Nano Developer Kit", "p3768-0000",
        gpu_cores=1024, tpcs=4, gpu_hz=_NANO_GPU_HZ, emc_hz=_EMC_HZ_NANO, dram_bus_bits=128,
        memory_gb=8, cpu_clusters=_HEXA_CLUSTERS, cpu_khz=_cpu_table(1510400, 1497600),
        modes=_NANO_MODES, default_mode=0, rails=_P3767_RAILS,
        power=_p3767_power(15.0), thermal=_P3767_THERMAL, has_dla=False,
        conf_name="nvpmodel_p3767_0003.conf"),
}

# JetPack 6.2 (L4T r36.4.3) turns every Orin Nano into the "Super" SKU: new clock table, EMC 3199,
# new modes (NVIDIA-AI-IOT jetson-generative-ai-playground benchmarks; nvpmodel_p3767_0003_super).
NANO_SUPER = replace(
    BOARDS["orin-nano-8gb"],
    model="NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
    gpu_hz=_NANO_SUPER_GPU_HZ, emc_hz=_EMC_HZ, cpu_khz=_cpu_table(1728000, 1728000),
    modes=_NANO_SUPER_MODES, default_mode=1, power=_p3767_power(25.0),
    conf_name="nvpmodel_p3767_0003_super.conf")

L4T_RELEASES = ("r35", "r36")


def board_for(name: str, l4t: str) -> BoardSpec:
    """The spec of a board name under an L4T release (the Nano becomes "Super" on r36)."""
    if name not in BOARDS:
        raise KeyError(f"unknown board {name!r}; valid boards: {', '.join(BOARDS)}")
    if l4t not in L4T_RELEASES:
        raise KeyError(f"unknown L4T release {l4t!r}; valid: {', '.join(L4T_RELEASES)}")
    if name == "orin-nano-8gb" and l4t == "r36":
        return NANO_SUPER
    return BOARDS[name]


def active_tpcs(spec: BoardSpec, tpc_pg_mask: int) -> int:
    """TPCs left powered by a TPC_PG_MASK (bit n set = TPC n gated; T234 has 8 TPC slots).
    AGX 248 -> 3, 240 -> 4 (ORIN.md: 15W 3 of 8, 30W 4 of 8); 32GB 128 -> 7; NX 252 -> 2."""
    return max(1, min(spec.tpcs, 8 - bin(tpc_pg_mask & 0xFF).count("1")))
