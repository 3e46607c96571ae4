"""The twin's truth: boards drawn from the ranges of the constants the cost model and the power model rest on,
so that in the energy bench the board is not the controller's planner.

Used by power.bench.energy (``bench power --boards N``) and power.bench.run (the twin's step times and rails).
The controller keeps its nominal model (power.physics) and learns the difference from the rails and the step
times, as on a board. Board 0 is the exact model (every constant nominal: the planner's own twin, the run
the bench made before boards were sampled); boards 1..N are drawn, each constant uniformly from its range,
from one seeded generator per board, and recorded with the results.

Each range says where it comes from. *derived*: computed from a cited measurement; *captured*: the spread of
public captures; *no source*: nothing public pins the constant, so the range is wide on purpose. A range
only widens what a constant may be; none was chosen for a goal.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from power.physics.boards import BoardSpec
from power.physics.costmodel import DEFAULT_PARAMS, CostParams
from power.physics.equations import EMC_IDLE_FLOOR_HZ


@dataclass(frozen=True)
class Range:
    name: str
    lo: float
    hi: float
    source: str


# The AGX Orin constants (power.physics.boards._AGX_POWER, costmodel.CostParams); the ranges below are for
# the AGX Orin 64GB, the board the bench's goals are about (on an Orin NX / Nano the SOC split and the
# carrier rail, captured on AGX only, stay nominal).
RANGES: tuple[Range, ...] = (
    # the runtime
    Range("bandwidth_eff", 0.75, 0.90, "derived: the nominal 0.80 x (1 - error) of the INT4 decode rows of "
          "docs/TWIN_VALIDATION.md that no runtime overhead dominates (rows 1, 8-13: -10.7 .. +1.9 %)"),
    Range("tensor_eff", 0.45, 0.70, "no source: one fitted point (TensorRT-LLM 1024-token prefill, "
          "TWIN_VALIDATION row 3); wide"),
    Range("cuda_eff", 0.30, 0.70, "no source: small-batch GEMV rate, an estimate; wide"),
    Range("overhead_cycles_per_layer", 20000.0, 80000.0, "no source: launch overhead, an estimate (row 2's "
          "+28 % at 128 tokens says TensorRT-LLM has a fixed per-request cost the term lacks); wide"),
    # switching activity (power)
    Range("prefill_intensity", 0.65, 1.00, "no source: prefill GEMMs against the GPU stress test; wide"),
    Range("decode_wait_intensity", 0.05, 0.30, "no source: chosen to land near an FP16 vLLM power point "
          "(EdgeReasoning, TWIN_VALIDATION row 14) while the bench runs INT4; wide"),
    Range("decode_core_intensity", 0.25, 0.65, "no source: as decode_wait_intensity; wide"),
    # the rails
    Range("soc_emc_w", 1.0, 2.5, "derived: the EMC rate's share of the captured 2.40 / 4.94 W VDD_GPU_SOC idle "
          "rails; 1.0-2.5 W fit the four GPU-stress points about equally (power.physics.boards); base and "
          "GPU leakage follow from the same two captures"),
    Range("gpu_exp", 2.0, 2.3, "published range: ORIN.md, 'about 2.0-2.3 on the dynamic part' of the GPU rail"),
    Range("dram_pj_per_byte", 45.0, 90.0, "derived: +3.7 W on the Orin Nano SOC rail while streaming "
          "(ORIN.md) over 60-100 % of its 68 GB/s peak = 54-91 pJ/B; below that, other SOC activity in the 3.7 W"),
    Range("dram_share_on_soc", 0.5, 0.9, "no source: the DRAM controller's part on VDD_GPU_SOC; wide"),
    Range("sys_w", 4.03, 4.77, "captured: VIN_SYS_5V0 in three public AGX Orin captures (power.physics.boards)"),
    Range("cpu_busy_scale", 1.0, 1.56, "derived: two busy cores read 4.41 W on VDD_CPU_CV where the all-core "
          "fit gives 2.83 W (TWIN_VALIDATION row 28): the engine's busy core may cost up to 1.56x the fit"),
)
# Not drawn: the EMC rate the bandwidth manager idles at under stock governors. Every public Orin capture
# found idles at 2133 MHz (catid's AGX Orin 64GB, MAXN, 2023-04-23; Orin Nano JetPack 6 tegrastats lines in
# public test fixtures); the 665.6 MHz idle lines found are AGX Xavier's (DataDog/datadog-agent
# jetson_test.go, agXSample) and L4T 38 (Thor) boards'. It stays at the captured rate.
# the captures the SOC split rests on (power.physics.boards): VDD_GPU_SOC rail-gated idle at EMC 2133 MHz,
# and with every clock pinned (jetson_clocks: GPU powered at its top clock, EMC 3199 MHz)
_SOC_IDLE_W, _SOC_PINNED_W = 2.40, 4.94


@dataclass(frozen=True)
class BoardTruth:
    """One board the bench runs every policy on: its constants and what was drawn."""
    index: int                          # 0: the exact model; 1..N: sampled
    seed: int
    spec: BoardSpec
    params: CostParams
    emc_idle_floor_hz: int
    values: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def label(self) -> str:
        return "exact model" if self.index == 0 else f"board {self.index}"

    def record(self) -> dict[str, object]:
        return {"board": self.index, "label": self.label, "seed": self.seed, "values": dict(self.values)}


def exact(spec: BoardSpec) -> BoardTruth:
    """The planner's own constants: the twin the bench ran before boards were sampled."""
    return BoardTruth(0, 0, spec, DEFAULT_PARAMS, EMC_IDLE_FLOOR_HZ)


def sample(spec: BoardSpec, n: int, seed: int = 0) -> list[BoardTruth]:
    """``n`` boards drawn from RANGES (board i from its own generator: board 3 is the same board whatever n)."""
    return [_draw(spec, i, seed) for i in range(1, n + 1)]


def nominal(spec: BoardSpec) -> dict[str, float]:
    """The value each drawn constant has in the planner's own model (the exact model's board)."""
    k, p = spec.power, DEFAULT_PARAMS
    return {"bandwidth_eff": p.bandwidth_eff, "tensor_eff": p.tensor_eff, "cuda_eff": p.cuda_eff,
            "overhead_cycles_per_layer": p.overhead_cycles_per_layer, "prefill_intensity": p.prefill_intensity,
            "decode_wait_intensity": p.decode_wait_intensity, "decode_core_intensity": p.decode_core_intensity,
            "soc_emc_w": k.soc_emc_w, "gpu_exp": k.gpu_exp, "dram_pj_per_byte": k.dram_j_per_byte * 1e12,
            "dram_share_on_soc": k.dram_share_on_soc, "sys_w": k.sys_w, "cpu_busy_scale": 1.0}


def _draw(spec: BoardSpec, index: int, seed: int) -> BoardTruth:
    rng = random.Random(f"orin-agent-board:{seed}:{index}")
    return board(spec, {r.name: rng.uniform(r.lo, r.hi) for r in RANGES}, index, seed)


def board(spec: BoardSpec, values: Mapping[str, float], index: int = -1, seed: int = 0) -> BoardTruth:
    """The board whose drawn constants are ``values`` (every name of RANGES; :func:`nominal` gives the
    planner's): a sampled board, or one constant moved alone (the sensitivity script)."""
    v = dict(values)
    k = spec.power
    power = replace(k, gpu_exp=v["gpu_exp"], dram_j_per_byte=v["dram_pj_per_byte"] * 1e-12,
                    dram_share_on_soc=v["dram_share_on_soc"], cpu_w_per_core=k.cpu_w_per_core * v["cpu_busy_scale"])
    if spec.rails[0].label == "VDD_GPU_SOC":
        # AGX Orin: the SOC split and the carrier rail come from AGX captures
        soc_emc = v["soc_emc_w"]
        base = _SOC_IDLE_W - soc_emc * 2133000000 / spec.emc_max_hz
        leak = (_SOC_PINNED_W - base - soc_emc) / spec.tpcs
        power = replace(power, soc_emc_w=soc_emc, soc_base_w=base, gpu_leak_w_per_tpc=leak, sys_w=v["sys_w"])
    else:           # Orin NX / Nano: no such captures; those constants stay nominal
        for name in ("soc_emc_w", "sys_w"):
            v.pop(name)
    params = replace(DEFAULT_PARAMS, bandwidth_eff=v["bandwidth_eff"], tensor_eff=v["tensor_eff"],
                     cuda_eff=v["cuda_eff"], overhead_cycles_per_layer=v["overhead_cycles_per_layer"],
                     prefill_intensity=v["prefill_intensity"], decode_wait_intensity=v["decode_wait_intensity"],
                     decode_core_intensity=v["decode_core_intensity"])
    return BoardTruth(index, seed, replace(spec, power=power), params, EMC_IDLE_FLOOR_HZ, MappingProxyType(v))
