"""Roofline cost model of one LLM step on a Jetson Orin at given clocks: time, bound and energy.

Used by the power controller (power.policy.dvfs) and the energy benchmark. Pure
arithmetic, no I/O. A step's time is the larger of its compute time (FLOPs at the GPU clock, the
active TPCs and an efficiency) and its memory time (bytes at the EMC bandwidth and an efficiency),
plus a per-layer launch overhead that scales with the GPU clock. Energy is the twin's power model
(``power.physics.equations.power``) at those clocks, times the step's time.

Published anchors it reproduces (tests/test_costmodel.py, ../shared/ORIN.md): AGX Orin 64GB MAXN,
Llama-3-8B INT4 weight-only decode about 35.9 tok/s and prefill 91 ms / 128 tokens, 582 ms / 1024
(TensorRT-LLM 0.12); the FP16 8B bandwidth ceiling about 12.8 tok/s; Orin Nano original -> Super
Llama-3.1-8B 4-bit 14.0 -> 19.1 tok/s and Llama-3.2-3B 27.7 -> 43.1 tok/s (jetson-generative-ai-
playground benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from power.physics.boards import BoardSpec, active_tpcs
from power.physics.equations import Activity, Clocks, Workload, power

# --- model shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def layer_params(self) -> int:
        """Linear weights of one layer: q, k, v, o and the SwiGLU MLP (norms are negligible)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        """The LM head, read whole at every step (tied or not, it is one vocab x hidden matrix)."""
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """K and V of every layer for one token (FP16 cache by default)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes


def shape_of(name: str, c: Any) -> ModelShape:
    """The shape of a model configuration (partition.config.ModelConfig: a preset, or the model being
    served), read by attribute: physics never imports the model package nor resolves a preset name
    (power.runtime.shapes does)."""
    return ModelShape(name, c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim,
                      c.intermediate_size, c.vocab_size, c.tie_word_embeddings)


# --- precision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Weight storage. Orin (sm_87) has no FP8/FP4: INT8 and INT4 are weight-only (ORIN.md)."""
    name: str
    weight_bytes: float     # bytes per weight, scales included
    head_bytes: float       # bytes per LM-head weight
    dequant_ops: float      # extra ops per weight in a decode GEMV


PRECISIONS = {
    "fp16": Precision("fp16", 2.0, 2.0, 0.0),
    # INT8 weight-only: per-channel scales, negligible per weight.
    "int8": Precision("int8", 1.0, 2.0, 1.0),
    # INT4 with an FP16 LM head: TensorRT-LLM / TensorRT Edge-LLM AWQ (W4A16, group 128, one FP16 scale per
    # group: +2/128 byte); both leave the head in FP16 by default. With it, Llama-3-8B reads 4.6 GB per token,
    # ORIN.md's "about 4.5 GB" (derived). For a small model with a big vocabulary the head dominates:
    # Llama-3.2-1B's tied 128k x 2048 head is half its bytes per token.
    "int4": Precision("int4", 0.5 + 2 / 128, 2.0, 2.0),
    # INT4 with the LM head quantised too: MLC's q4f16_1 (group 32, one FP16 scale: 4.5 bits, head included;
    # the runtime behind the Orin Nano rows of docs/TWIN_VALIDATION.md). "q4f16" is the same format.
    "q4f16_1": Precision("q4f16_1", 0.5 + 2 / 32, 0.5 + 2 / 32, 2.0),
    "q4f16": Precision("q4f16", 0.5 + 2 / 32, 0.5 + 2 / 32, 2.0),
    # llama.cpp's Q4_K_M: 4.8944 bits per weight over Llama-3.1-8B (llama.cpp tools/quantize/README.md, 4.58 GiB),
    # with the token embedding at Q4_K (4.5 bpw) and the output head at Q6_K (6.5625 bpw); the rest, the body,
    # is then (4.8944 x 8.03e9 - 0.525e9 x 4.5 - 0.525e9 x 6.5625) / 6.98e9 = 4.80 bpw (derived; Q6_K for half
    # the attn_v / ffn_down tensors makes it more than Q4_K's 4.5).
    "q4_k_m": Precision("q4_k_m", 4.80 / 8, 6.5625 / 8, 2.0),
}

# --- hardware throughput and efficiencies ------------------------------------------------------------

# Dense FP16 tensor throughput per TPC per cycle, derived: ~42.5 dense FP16 TFLOPS (half of 85 dense
# INT8 TOPS, half of the published 170 sparse) / (8 TPC x 1.3005 GHz) = 4085.
TENSOR_FLOP_PER_TPC_CYCLE = 4096
# CUDA-core FP32 FMA throughput: 256 cores per TPC x 2 FLOP (5.3 TFLOPS at 8 TPC x 1.3 GHz, published).
CUDA_FLOP_PER_TPC_CYCLE = 512


@dataclass(frozen=True)
class CostParams:
    """Efficiencies (fractions of peak) a good runtime reaches, and the switching activity of its steps.

    - ``bandwidth_eff`` 0.80, fitted: it puts TensorRT-LLM Llama-3-8B INT4 decode at 33.9 tok/s (measured
      35.9, docs/TWIN_VALIDATION.md row 1); ``tensor_eff`` 0.60, fitted: 573 ms for a 1024-token prefill
      (measured 582 ms, row 3). Each rests on one point; the sampled-board bench (power.bench.truth) draws
      them from 0.75-0.90 and 0.45-0.70.
    - ``cuda_eff`` 0.50 and ``overhead_cycles_per_layer`` 40000 (~1 ms per step at 1.3 GHz): no source,
      estimates (row 2, +28 % at 128 tokens, says TensorRT-LLM has a per-request cost this term lacks); the
      sampled boards draw 0.30-0.70 and 20000-80000.
    - ``*_intensity``: switching activity relative to the GPU stress test behind the GPU-rail fit. No
      source: compute-bound GEMMs run near it (0.85); a memory-bound decode step toggles ~0.15 while it
      waits plus 0.45 x its CUDA-core share. They were chosen to land AGX decode of an 8B model near
      EdgeReasoning's 22-27 W, an FP16 vLLM figure (row 14), while the bench runs INT4, and no public INT4
      power point on AGX exists; the sampled boards draw 0.65-1.0, 0.05-0.30 and 0.25-0.65.
    """
    bandwidth_eff: float = 0.80
    tensor_eff: float = 0.60
    cuda_eff: float = 0.50
    overhead_cycles_per_layer: float = 40000.0   # kernel launches / syncs, ~1 ms per step at 1.3 GHz
    kv_bytes: float = 2.0                        # FP16 KV cache
    gemm_batch: int = 8                          # from this many rows on, decode runs on tensor cores
    prefill_intensity: float = 0.85
    decode_wait_intensity: float = 0.15
    decode_core_intensity: float = 0.45


# the defaults above, by their old names
PREFILL_INTENSITY = CostParams.prefill_intensity
DECODE_WAIT_INTENSITY = CostParams.decode_wait_intensity
DECODE_CORE_INTENSITY = CostParams.decode_core_intensity

DEFAULT_PARAMS = CostParams()

# What each runtime reaches on Orin (``twin predict --runtime``). The defaults are TensorRT-LLM's (fitted to
# its AGX rows); the others are fitted to their own rows of docs/TWIN_VALIDATION.md (marked "fitted" there,
# so the medians of held-out rows are the test), each a least-squares fit in log tok/s:
# - mlc: bandwidth 0.92 of peak and 145000 cycles of overhead per layer per step (~3.6x TensorRT-LLM's:
#   ~4.6 ms per step for a 32-layer model on a 1 GHz Nano Super), fitted to the four MLC Llama rows on Orin
#   Nano (rows 8-11, q4f16_1); held out: the two Qwen2.5-7B rows.
# - llama.cpp: bandwidth 0.545 of peak (fitted to its 8B Q4_K_M decode, row 5: 23.5 tok/s) and tensor
#   efficiency 0.174 (its prefill, row 6: 523 tok/s at 512 tokens); no held-out llama.cpp row with a preset
#   shape was found.
RUNTIMES: dict[str, CostParams] = {
    "tensorrt-llm": DEFAULT_PARAMS,
    "mlc": CostParams(bandwidth_eff=0.92, overhead_cycles_per_layer=145000.0),
    "llama.cpp": CostParams(bandwidth_eff=0.545, tensor_eff=0.174),
}
# the precision each runtime ships its 4-bit models in
RUNTIME_INT4 = {"tensorrt-llm": "int4", "mlc": "q4f16_1", "llama.cpp": "q4_k_m"}

# --- operating point and result ------------------------------------------------------------------------


@dataclass(frozen=True)
class OperatingPoint:
    gpu_hz: int
    emc_hz: int
    tpcs: int
    cpu_khz: int = 1497600
    cores_online: int | None = None     # None: every core of the board (cpu0 first, cluster by cluster)

    @classmethod
    def of_mode(cls, spec: BoardSpec, mode_id: int | None = None) -> "OperatingPoint":
        """The clocks jetson_clocks would pin in a power mode (its caps; the board's maxima)."""
        m = spec.mode(spec.default_mode if mode_id is None else mode_id)
        gpu = max(f for f in spec.gpu_hz if f <= (m.gpu_max_hz or spec.gpu_max_hz))
        emc = max(f for f in spec.emc_hz if f <= (m.emc_cap_hz or spec.emc_max_hz))
        cpu = max(f for f in spec.cpu_khz if f <= (m.cpu_max_khz or spec.cpu_khz[-1]))
        return cls(gpu, emc, active_tpcs(spec, m.tpc_pg_mask), cpu)


@dataclass(frozen=True)
class StepCost:
    phase: str
    seconds: float
    compute_s: float
    memory_s: float
    overhead_s: float
    flops: float
    bytes: float
    intensity: float
    power_w: float
    energy_j: float
    tokens: int                     # tokens produced (decode: batch) or consumed (prefill)
    rails_w: tuple[tuple[str, float], ...] = field(default=())

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def dram_bytes_per_s(self) -> float:
        return self.bytes / self.seconds

    @property
    def joules_per_token(self) -> float:
        return self.energy_j / self.tokens

    def workload(self, spec: BoardSpec, op: OperatingPoint) -> Workload:
        """The twin workload this step presents at ``op`` (GPU busy throughout the step)."""
        mem = min(1.0, self.dram_bytes_per_s / spec.dram_bytes_per_s(op.emc_hz))
        return Workload(self.phase, 1.0, mem, 1.0, self.intensity)


def _finish(spec: BoardSpec, op: OperatingPoint, phase: str, tokens: int, flops: float,
            nbytes: float, compute_s: float, overhead_s: float, p: CostParams) -> StepCost:
    memory_s = nbytes / (spec.dram_bytes_per_s(op.emc_hz) * p.bandwidth_eff)
    seconds = max(compute_s, memory_s) + overhead_s
    frac = compute_s / seconds
    if phase == "prefill":
        intensity = p.prefill_intensity * frac
    else:
        intensity = p.decode_wait_intensity + p.decode_core_intensity * frac
    clusters = len(spec.cpu_clusters)
    clocks = Clocks(op.gpu_hz, op.emc_hz, op.tpcs, (op.cpu_khz,) * clusters, cores_per_cluster(spec, op.cores_online))
    pw = power(spec, clocks, Activity(1.0, intensity, nbytes / seconds, 1.0))
    return StepCost(phase, seconds, compute_s, memory_s, overhead_s, flops, nbytes, intensity,
                    pw.board_w, pw.board_w * seconds, tokens, pw.rails)


def cores_per_cluster(spec: BoardSpec, online: int | None) -> tuple[int, ...]:
    """Online cores per cluster when ``online`` cores are kept, filling from cpu0's cluster (None: all)."""
    left = spec.cpu_count if online is None else max(1, min(spec.cpu_count, online))
    out = []
    for c in spec.cpu_clusters:
        out.append(min(len(c), left))
        left -= out[-1]
    return tuple(out)


def _weight_bytes(shape: ModelShape, prec: Precision) -> float:
    return shape.body_params * prec.weight_bytes + shape.head_params * prec.head_bytes


def decode_step(spec: BoardSpec, shape: ModelShape, precision: str, op: OperatingPoint,
                context: int, batch: int = 1, params: CostParams = DEFAULT_PARAMS) -> StepCost:
    """One decode step: ``batch`` sequences, each ``context`` tokens long, one new token each."""
    prec = PRECISIONS[precision]
    q_dim = shape.heads * shape.head_dim
    params_n = shape.body_params + shape.head_params
    attn = 4 * shape.layers * q_dim * context * batch            # QK^T and PV
    flops = 2 * params_n * batch + attn
    nbytes = _weight_bytes(shape, prec) + batch * context * shape.kv_bytes_per_token(params.kv_bytes)
    # each weight tile is dequantised once per step, for every row of the batch (GEMV and GEMM kernels
    # alike load a tile, expand it in registers/shared memory and use it for all rows)
    ops = flops + shape.body_params * prec.dequant_ops
    overhead = shape.layers * params.overhead_cycles_per_layer / op.gpu_hz
    return _finish(spec, op, "decode", batch, flops, nbytes, ops / decode_rate(op, batch, params), overhead, params)


def decode_rate(op: OperatingPoint, batch: int, params: CostParams = DEFAULT_PARAMS) -> float:
    """FLOP/s of a decode step's matrix work: tensor cores from ``params.gemm_batch`` rows on, else
    small-batch GEMV on CUDA cores."""
    if batch >= params.gemm_batch:
        return op.tpcs * TENSOR_FLOP_PER_TPC_CYCLE * op.gpu_hz * params.tensor_eff
    return op.tpcs * CUDA_FLOP_PER_TPC_CYCLE * op.gpu_hz * params.cuda_eff


def prefill_step(spec: BoardSpec, shape: ModelShape, precision: str, op: OperatingPoint,
                 tokens: int, context: int = 0, params: CostParams = DEFAULT_PARAMS) -> StepCost:
    """A prefill of ``tokens`` new tokens after ``context`` cached ones (logits for the last only)."""
    prec = PRECISIONS[precision]
    q_dim = shape.heads * shape.head_dim
    attn = 4 * shape.layers * q_dim * tokens * (context + tokens / 2)   # causal
    flops = 2 * shape.body_params * tokens + attn + 2 * shape.head_params
    kv = shape.kv_bytes_per_token(params.kv_bytes)
    nbytes = _weight_bytes(shape, prec) + kv * (context + tokens)
    rate = op.tpcs * TENSOR_FLOP_PER_TPC_CYCLE * op.gpu_hz * params.tensor_eff
    overhead = shape.layers * params.overhead_cycles_per_layer / op.gpu_hz
    return _finish(spec, op, "prefill", tokens, flops, nbytes, flops / rate, overhead, params)


def decode_tokens_per_s(spec: BoardSpec, shape: ModelShape, precision: str, op: OperatingPoint,
                        context: int = 512, params: CostParams = DEFAULT_PARAMS) -> float:
    return 1.0 / decode_step(spec, shape, precision, op, context, 1, params).seconds


def bandwidth_ceiling_tokens_per_s(spec: BoardSpec, shape: ModelShape, precision: str,
                                   emc_hz: int | None = None) -> float:
    """ORIN.md's arithmetic: peak bandwidth / weight bytes (no KV, no inefficiency)."""
    return spec.dram_bytes_per_s(emc_hz or spec.emc_max_hz) / _weight_bytes(shape, PRECISIONS[precision])

