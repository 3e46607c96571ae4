"""One operating point of the twin, predicted: tok/s, step time, rail watts and J/token for a board,
a model shape, a precision, a runtime (its efficiencies and per-step overhead, costmodel.RUNTIMES) and
clocks (or a power mode's caps). ``orin-agent twin predict`` prints it,
so anyone can hold the twin against a measurement (docs/TWIN_VALIDATION.md).

Pure arithmetic over ``power.physics.costmodel`` (step time) and ``power.physics.equations.power``
(rails); no I/O. Clocks not given are the power mode's caps (what ``jetson_clocks`` pins there);
clocks given are snapped to the nearest entry of the board's table and capped by the mode.
"""
from __future__ import annotations

from dataclasses import dataclass

from power.physics.boards import BoardSpec, active_tpcs, board_for
from power.physics.costmodel import PRECISIONS, RUNTIMES, ModelShape, OperatingPoint, decode_step, prefill_step


@dataclass(frozen=True)
class PointQuery:
    shape: ModelShape               # the model (power.runtime.shapes.model_shape for a preset's name)
    board: str = "agx-orin-64gb"
    l4t: str = "r36"
    precision: str = "int4"
    phase: str = "decode"           # decode: one token per sequence per step; prefill: ``tokens`` in one step
    tokens: int = 512               # decode: context length; prefill: prompt tokens
    batch: int = 1
    nvpmodel: str | None = None     # mode name or id; None = the mode without GPU/EMC caps
    gpu_mhz: float | None = None
    emc_mhz: float | None = None
    runtime: str = "tensorrt-llm"   # whose efficiencies and per-step overhead (costmodel.RUNTIMES)


@dataclass(frozen=True)
class PointPrediction:
    board: str
    shape: str
    precision: str
    phase: str
    mode: str
    gpu_mhz: float
    emc_mhz: float
    tpcs: int
    tokens: int
    batch: int
    step_ms: float
    tokens_per_s: float             # decode: batch / step; prefill: prompt tokens / step
    bound: str
    board_w: float
    rails_w: dict[str, float]
    joules_per_token: float
    runtime: str = "tensorrt-llm"


def _mode(spec: BoardSpec, name: str | None) -> int:
    if name is None:        # the mode without GPU/EMC caps (MAXN, MAXN_SUPER; the original Nano's 15W)
        return next((m.id for m in spec.modes if m.gpu_max_hz is None and m.emc_cap_hz is None), 0)
    for m in spec.modes:
        if name == str(m.id) or name.upper() == m.name.upper():
            return m.id
    raise ValueError(f"{spec.name} has no power mode {name!r}; modes: "
                     f"{', '.join(f'{m.id} {m.name}' for m in spec.modes)}")


def _nearest(table: tuple[int, ...], hz: float) -> int:
    """The table entry nearest a requested clock (1300 MHz means the 1300.5 MHz entry)."""
    return min(table, key=lambda f: abs(f - hz))


def predict_point(q: PointQuery) -> PointPrediction:
    """The twin's prediction for one operating point (ValueError on an unknown board or a bad size)."""
    shape = q.shape
    try:
        spec = board_for(q.board, q.l4t)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    if q.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {q.precision!r}; allowed: {', '.join(PRECISIONS)}")
    if q.runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {q.runtime!r}; allowed: {', '.join(RUNTIMES)}")
    params = RUNTIMES[q.runtime]
    if q.phase not in ("decode", "prefill"):
        raise ValueError(f"unknown phase {q.phase!r}; allowed: decode, prefill")
    if q.tokens < 1 or q.batch < 1:
        raise ValueError(f"tokens and batch must be >= 1 (got {q.tokens}, {q.batch})")
    mode_id = _mode(spec, q.nvpmodel)
    top = OperatingPoint.of_mode(spec, mode_id)
    gpu = top.gpu_hz if q.gpu_mhz is None else min(top.gpu_hz, _nearest(spec.gpu_hz, q.gpu_mhz * 1e6))
    emc = top.emc_hz if q.emc_mhz is None else min(top.emc_hz, _nearest(spec.emc_hz, q.emc_mhz * 1e6))
    op = OperatingPoint(gpu, emc, active_tpcs(spec, spec.mode(mode_id).tpc_pg_mask), top.cpu_khz)
    if q.phase == "decode":
        c = decode_step(spec, shape, q.precision, op, q.tokens, q.batch, params)
        produced = q.batch
    else:
        c = prefill_step(spec, shape, q.precision, op, q.tokens, 0, params)
        produced = q.tokens
    return PointPrediction(spec.name, shape.name, q.precision, q.phase, spec.mode(mode_id).name, gpu / 1e6,
                           emc / 1e6, op.tpcs, q.tokens, q.batch, c.seconds * 1e3, produced / c.seconds,
                           c.bound, c.power_w, dict(c.rails_w), c.energy_j / produced, q.runtime)
