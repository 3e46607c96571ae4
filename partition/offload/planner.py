"""The split planner: how many layers run on the device, the rest on the edge.

For every split N (N = L: device only) it adds up one decode token: the device's layers 0:N (the
power package's roofline cost model, `power.physics.costmodel.decode_step`, on the device board at its power
mode's clocks), the link (RTT plus the bytes at the measured bandwidth) and the edge's layers N:L
plus the LM head (the same cost model on the edge board). Device energy per token is the device's
step energy plus its idle board power while it waits for the edge (the twin's power model); radio
energy is not modelled. Splits whose device memory (weights of N layers + KV-cache) does not fit, or
whose step power exceeds the device's budget, are ruled out. A fraction of tokens that exit early on
the device (`exit_rate`, from the early-exit statistics) skip the link and the edge.

The link's RTT and bandwidth come from the caller: the CLI's flags, or `EdgeLink.stats()` measured
on live exchanges, so re-planning when the link changes is calling `plan` again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from partition.offload.protocol import bytes_down, bytes_up
from power.physics.boards import BOARDS, BoardSpec
from power.physics.costmodel import ModelShape, OperatingPoint, decode_step
from power.physics.equations import Activity, Clocks, power

OBJECTIVES = ("tok-s", "energy")


MIN_MBPS = 0.1  # the floor of a measured bandwidth (a probe or a link with no multi-position exchange yet)


@dataclass(frozen=True)
class LinkEstimate:
    rtt_ms: float
    mbps: float


@dataclass(frozen=True)
class SplitCost:
    device_layers: int
    device_ms: float
    link_ms: float
    edge_ms: float
    tok_s: float
    device_j_per_token: float
    bytes_per_token: int
    device_power_w: float
    device_mem_gb: float
    feasible: bool
    why_not: str


@dataclass(frozen=True)
class Plan:
    model: str
    device_board: str
    edge_board: str
    link: LinkEstimate
    objective: str
    choice: int
    reason: str
    splits: tuple[SplitCost, ...]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _op(spec: BoardSpec) -> OperatingPoint:
    return OperatingPoint.of_mode(spec)


def idle_w(spec: BoardSpec, op: OperatingPoint) -> float:
    clocks = Clocks(op.gpu_hz, op.emc_hz, op.tpcs, (op.cpu_khz,) * len(spec.cpu_clusters),
                    tuple(len(c) for c in spec.cpu_clusters))
    return power(spec, clocks, Activity(0.0, 0.0, 0.0, 0.0)).board_w


def split_cost(shape: ModelShape, n: int, device: BoardSpec, edge: BoardSpec, link: LinkEstimate,
               precision: str = "fp16", context: int = 512, exit_rate: float = 0.0,
               power_budget_w: float | None = None) -> SplitCost:
    """One decode token with layers 0:n on the device (n = shape.layers: no edge)."""
    L = shape.layers
    dop, eop = _op(device), _op(edge)
    dev = decode_step(device, replace(shape, layers=n, vocab=shape.vocab if n == L else 0), precision, dop, context)
    device_s, device_j = dev.seconds, dev.energy_j
    link_s = edge_s = 0.0
    nbytes = 0
    if n < L:
        edge_step = decode_step(edge, replace(shape, layers=L - n), precision, eop, context)
        nbytes = bytes_up(1, shape.hidden) + bytes_down(shape.vocab, False)
        link_s = link.rtt_ms / 1e3 + nbytes * 8 / (link.mbps * 1e6)
        edge_s = edge_step.seconds
        wait_s = (1.0 - exit_rate) * (link_s + edge_s)
        device_s += wait_s
        device_j += idle_w(device, dop) * wait_s
    mem_gb = dev.bytes / 1e9    # the device's weights of layers 0:n (+ head when n = L) and their KV-cache
    why = ""
    if mem_gb > device.memory_gb:
        why = f"needs {mem_gb:.1f} GB on a {device.memory_gb} GB board"
    elif power_budget_w is not None and dev.power_w > power_budget_w:
        why = f"draws {dev.power_w:.1f} W over the {power_budget_w:g} W budget"
    return SplitCost(n, round(dev.seconds * 1e3, 3), round(link_s * 1e3, 3), round(edge_s * 1e3, 3),
                     round(1.0 / device_s, 3), round(device_j, 5), int(nbytes * (1.0 - exit_rate)),
                     round(dev.power_w, 2), round(mem_gb, 3), not why, why)


def check_choice(objective: str, *boards: str) -> None:
    """ValueError unless `objective` is one of OBJECTIVES and every board is in the twin's BOARDS."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    for b in boards:
        if b not in BOARDS:
            raise ValueError(f"unknown board {b!r}; boards: {', '.join(BOARDS)}")


def plan(shape: ModelShape, device_board: str, link: LinkEstimate, edge_board: str = "agx-orin-64gb",
         precision: str = "fp16", context: int = 512, exit_rate: float = 0.0,
         power_budget_w: float | None = None, objective: str = "tok-s") -> Plan:
    """Every split from 1 layer on the device to all of them; the best feasible one and why."""
    check_choice(objective, device_board, edge_board)
    if link.rtt_ms < 0 or link.mbps <= 0:
        raise ValueError(f"a link needs RTT >= 0 ms and bandwidth > 0 Mbit/s (got {link.rtt_ms}, {link.mbps})")
    if not 0.0 <= exit_rate < 1.0:
        raise ValueError(f"exit rate must be in [0, 1), got {exit_rate}")
    device, edge = BOARDS[device_board], BOARDS[edge_board]
    costs = tuple(split_cost(shape, n, device, edge, link, precision, context, exit_rate, power_budget_w)
                  for n in range(1, shape.layers + 1))
    feasible = [c for c in costs if c.feasible]
    if not feasible:
        raise ValueError("no split fits the device: " + "; ".join(f"N={c.device_layers}: {c.why_not}" for c in costs))
    key = (lambda c: (-c.tok_s, c.device_j_per_token)) if objective == "tok-s" else \
          (lambda c: (c.device_j_per_token, -c.tok_s))
    best = min(feasible, key=key)
    local = costs[-1]
    per = f"device {best.device_ms:.2f} ms + link {best.link_ms:.2f} ms + edge {best.edge_ms:.2f} ms"
    if best.device_layers == shape.layers:
        reason = (f"device only: {best.tok_s:.1f} tok/s, {best.device_j_per_token:.3f} J/token; the best offload "
                  f"(N={max(feasible[:-1] or [best], key=lambda c: c.tok_s).device_layers}) loses to the link's "
                  f"{link.rtt_ms:g} ms RTT")
    else:
        reason = (f"N={best.device_layers}: {best.tok_s:.1f} tok/s ({per}), {best.device_j_per_token:.3f} J/token "
                  f"on the device, {best.bytes_per_token} B/token; device only: {local.tok_s:.1f} tok/s, "
                  f"{local.device_j_per_token:.3f} J/token")
    return Plan(shape.name, device_board, edge_board, link, objective, best.device_layers, reason, costs)


def format_plan(p: Plan) -> str:
    rows = [f"{'N':>3} {'tok/s':>8} {'dev ms':>8} {'link ms':>8} {'edge ms':>8} {'J/tok':>8} {'B/tok':>6}  note"]
    for c in p.splits:
        mark = "<- choice" if c.device_layers == p.choice else c.why_not
        rows.append(f"{c.device_layers:>3} {c.tok_s:>8.2f} {c.device_ms:>8.2f} {c.link_ms:>8.2f} {c.edge_ms:>8.2f} "
                    f"{c.device_j_per_token:>8.4f} {c.bytes_per_token:>6}  {mark}")
    head = (f"{p.model} on {p.device_board}, edge {p.edge_board}, link {p.link.rtt_ms:g} ms / {p.link.mbps:g} Mbit/s "
            f"({p.objective}): run {p.choice} layers on the device")
    return "\n".join([head, *rows, f"why: {p.reason}"])
