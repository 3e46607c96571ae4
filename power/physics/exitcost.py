"""What early exits save in a decode step, by the roofline of ``power.physics.costmodel``: the expected
cost of one decode step of ``batch`` rows when each token leaves after exit layer L with a measured
rate (the rest run to full depth). Pure arithmetic.

The runtime it prices is the one in ``partition.exits.runtime`` / ``agent.engine.speculative``:

- a token that leaves at L runs layers [0, L) now, plus the exit heads at every exit layer it passed
  (each a d x d translator and the whole LM head: a head evaluation reads the LM head again);
- the layers it skipped are not skipped for good: its hidden state waits in a backlog, and the next
  token that goes deep runs them over the backlog and itself in one batch, so the KV-cache stays
  exact. In the memory-bound regime that costs the backlog's FLOPs, not another read of the weights;
- rows of a batch are priced as if the step ran layer by layer over the rows still in it (a block of
  layers is read once when any row reaches it): with B rows a block is skipped only when all B left
  before it, so exits save weight traffic at batch 1 and almost none at batch 8. (The Python runtime
  runs exit-mode rows one at a time, which is worse; this is the batched runtime's cost.)

``gate=True`` prices an ideal gate: an exit head is computed only where the token then leaves (the
ceiling any real gate approaches from above). The rates are given as depth fractions ("2/8:0.034":
3.4 % of tokens leave after layer 2 of 8) and mapped onto the priced shape's layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from power.physics.boards import BoardSpec
from power.physics.costmodel import (DEFAULT_PARAMS, PRECISIONS, CostParams, ModelShape, OperatingPoint, StepCost,
                                     _finish, decode_rate)

TRANSLATOR_BYTES = 2.0  # the exit heads' d x d translators are stored in FP16 (exits.safetensors)


@dataclass(frozen=True)
class ExitRates:
    """Measured exit rates: (exit depth as a fraction of the model's layers, share of decode tokens
    that leave there), shallowest first; the remainder runs to full depth."""

    rates: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        fracs = [f for f, _ in self.rates]
        if fracs != sorted(set(fracs)) or any(not 0 < f < 1 for f in fracs):
            raise ValueError(f"exit depths must be distinct fractions in (0, 1), shallowest first: {fracs}")
        if any(r < 0 for _, r in self.rates) or sum(r for _, r in self.rates) > 1 + 1e-9:
            raise ValueError(f"exit rates must be >= 0 and sum to at most 1: {[r for _, r in self.rates]}")

    def on(self, layers: int) -> list[tuple[int, float]]:
        """(exit layer, rate) on a model of ``layers`` layers (the nearest layer to each depth)."""
        return [(min(layers - 1, max(1, round(f * layers))), r) for f, r in self.rates]

    @property
    def full_rate(self) -> float:
        return max(0.0, 1.0 - sum(r for _, r in self.rates))

    def describe(self) -> str:
        return ", ".join(f"{f:.3g} of depth: {r:.1%}" for f, r in self.rates) + f", full: {self.full_rate:.1%}"


def parse_exit_rates(text: str) -> ExitRates:
    """``"2/8:0.034,4/8:0.027,6/8:0.035"``: after layer 2 of 8, 3.4 % of tokens leave, and so on."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            depth, rate = part.split(":")
            layer, of = depth.split("/")
            out.append((int(layer) / int(of), float(rate)))
        except ValueError:
            raise ValueError(f"exit rates: {part!r} is not LAYER/LAYERS:RATE (e.g. 2/8:0.034)") from None
    if not out:
        raise ValueError("exit rates: none given (e.g. 2/8:0.034,4/8:0.027,6/8:0.035)")
    return ExitRates(tuple(sorted(out)))


def exit_decode_step(spec: BoardSpec, shape: ModelShape, precision: str, op: OperatingPoint, context: int,
                     batch: int, exits: ExitRates, gate: bool = False,
                     params: CostParams = DEFAULT_PARAMS) -> StepCost:
    """The expected decode step of ``batch`` rows with early exits at ``exits``' rates (see above)."""
    prec = PRECISIONS[precision]
    n, lp, d = shape.layers, shape.layer_params, shape.hidden
    points = exits.on(n)
    bounds = [0] + [l for l, _ in points] + [n]
    # s[k]: a row's probability of running block k = [bounds[k], bounds[k+1]) now
    s = [1.0]
    for _, r in points:
        s.append(max(0.0, s[-1] - r))
    any_row = [1.0 - (1.0 - p) ** batch for p in s]  # the batch reads block k's weights
    blocks = [b - a for a, b in zip(bounds, bounds[1:])]
    layers_read = sum(a * b for a, b in zip(any_row, blocks))
    layers_per_row = sum(p * b for p, b in zip(s, blocks))
    backlog_layers = sum(r * (n - l) for l, r in points)  # per row: deep layers its exited tokens owe
    head_params, translator = shape.head_params, d * d
    if gate:  # heads only where a token leaves (an ideal gate), the final head for the rest
        head_evals_row = sum(r for _, r in points) + s[-1]
        head_reads = sum(1.0 - (1.0 - r) ** batch for _, r in points) + any_row[-1]
        translators_row = sum(r for _, r in points)
    else:  # every row still running evaluates the head at each exit layer it reaches
        head_evals_row = sum(s[:len(points)]) + s[-1]
        head_reads = sum(any_row[:len(points)]) + any_row[-1]
        translators_row = sum(s[:len(points)])
    q_dim = shape.heads * shape.head_dim
    attn = 4 * q_dim * context * batch * (layers_per_row + backlog_layers)
    flops = 2 * batch * (lp * (layers_per_row + backlog_layers) + head_params * head_evals_row
                         + translator * translators_row) + attn
    translator_reads = head_reads - any_row[-1]  # every head read but the final one has a translator
    kv = shape.kv_bytes_per_token(params.kv_bytes) / n  # per layer and token
    nbytes = (layers_read * lp * prec.weight_bytes + head_reads * head_params * prec.head_bytes
              + translator_reads * translator * TRANSLATOR_BYTES + batch * context * kv * layers_per_row)
    ops = flops + layers_read * lp * prec.dequant_ops
    # launches: one per layer read, and an exit decision (a head, then a device-to-host read of its
    # top-1 probability) costs about one layer's launch overhead too (an estimate, like the per-layer one)
    overhead = (layers_read + translator_reads) * params.overhead_cycles_per_layer / op.gpu_hz
    return _finish(spec, op, "decode", batch, flops, nbytes, ops / decode_rate(op, batch, params), overhead, params)
