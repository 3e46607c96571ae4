"""The power configuration a power budget runs under: which nvpmodel mode (its GPU TPC mask, its caps) and
how many CPU cores online, chosen once, when the budget is set (service start, ``power set --power-cap``),
to give the most predicted tokens per second within ``watts``.

Why once: a mode that changes the TPC power-gating mask needs a reboot on AGX Orin (ORIN.md field notes),
so the service cannot switch it while it serves (the mode switch itself is refused without
``--allow-reboot-modes``, see ``power.runtime.applier.ClockApplier.set_mode``); CPU hotplug takes milliseconds and
migrates threads, for ~0.03 W a core on this twin (``PowerConstants.cpu_floor_w`` / 12), so cores are not
worth toggling per phase either.

The prediction (pure, no I/O): per mode, with its TPCs, its GPU/EMC caps and the cores kept, the cost model
(``power.physics.costmodel``) gives each (GPU, EMC) point's prefill and decode speed and board power; a served
request of the mix costs ``prompt`` prefill tokens and ``output`` decode tokens at ``batch`` rows. Every
(prefill point, decode point) pair is one way to serve the mix (average power, output tokens/s); the
budget's sliding window lets the controller time-share two ways, so the best rate within ``watts`` is the
upper concave hull of those pairs at ``watts``. The mode with the highest rate wins (ties: the lower least
power). ``power_scale`` multiplies every predicted power: the rails' measured/predicted ratio where known.

Cores: under a budget that binds (the mode's fastest way draws more than ``watts``) only the fewest cores any
nvpmodel mode of the board keeps online stay online (NVIDIA's own minimum for serving there: 4 on AGX Orin
and Orin Nano); else the mode's own count.
"""
from __future__ import annotations

from dataclasses import dataclass

from power.physics.boards import BoardSpec, ModeSpec, active_tpcs
from power.physics.costmodel import ModelShape, OperatingPoint, decode_step, prefill_step
from power.policy.price import pareto_front

PREFILL_CHUNK = 512         # the scheduler's max_prefill_chunk: prefill runs in chunks of this size


@dataclass(frozen=True)
class Mix:
    """What one served request costs: the batch trace's medians (power.bench.traces) by default."""
    prompt: int = 1000
    output: int = 250
    batch: int = 8


@dataclass(frozen=True)
class ConfigOption:
    mode: str
    tpcs: int
    cores_online: int
    tokens_per_s: float         # predicted output tokens/s of the mix within the budget (0: not even the floor fits)
    floor_w: float              # the least average power any way of serving the mix draws in this mode
    full_w: float               # the power of its fastest way (above the budget: the budget binds)


@dataclass(frozen=True)
class ConfigChoice:
    mode: str
    cores_online: int
    tokens_per_s: float
    options: tuple[ConfigOption, ...]

    def summary(self, watts: float) -> str:
        alts = "".join(f"; {o.mode} {o.tokens_per_s:.1f}" for o in self.options if o.mode != self.mode)
        return (f"power budget {watts:g} W: {self.mode} with {self.cores_online} CPU cores online "
                f"({self.tokens_per_s:.1f} output tok/s predicted{alts})")


def hull_rate(ways: list[tuple[float, float]], watts: float) -> float:
    """The best rate within ``watts`` average power, time-sharing two of the (power, rate) ways."""
    best = max((r for p, r in ways if p <= watts), default=0.0)
    lo = [w for w in ways if w[0] <= watts]
    hi = [w for w in ways if w[0] > watts]
    for p1, r1 in lo:
        for p2, r2 in hi:
            a = (p2 - watts) / (p2 - p1)
            best = max(best, a * r1 + (1 - a) * r2)
    return best


def _frontier(ways: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (W, rate) ways on the Pareto front, by rising power."""
    return pareto_front(ways, power=lambda w: w[0], speed=lambda w: w[1])


def _points(spec: BoardSpec, shape: ModelShape, precision: str, mode: ModeSpec, cores: int | None, mix: Mix,
            power_scale: float, rail: str | None = None) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(W, seconds per token) of prefill and of decode at every (GPU, EMC) point of ``mode``; W of the board,
    or of ``rail``."""
    gpus = [g for g in spec.gpu_hz if g <= (mode.gpu_max_hz or spec.gpu_max_hz)]
    emcs = [e for e in spec.emc_hz if e <= (mode.emc_cap_hz or spec.emc_max_hz)]
    return grid_points(spec, shape, precision, active_tpcs(spec, mode.tpc_pg_mask), gpus, emcs, cores, mix,
                       power_scale, rail)


def grid_points(spec: BoardSpec, shape: ModelShape, precision: str, tpcs: int, gpus: list[int], emcs: list[int],
                cores: int | None, mix: Mix, power_scale: float = 1.0,
                rail: str | None = None) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(W, seconds per token) of the mix's prefill chunk and decode step at every (GPU, EMC) point of the grid."""
    chunk = min(PREFILL_CHUNK, mix.prompt)
    ctx = mix.prompt + mix.output // 2
    pre, dec = [], []
    for g in gpus:
        for e in emcs:
            op = OperatingPoint(g, e, tpcs, cores_online=cores)
            p = prefill_step(spec, shape, precision, op, chunk)
            d = decode_step(spec, shape, precision, op, ctx, mix.batch)
            pw, dw = (p.power_w, d.power_w) if rail is None else (dict(p.rails_w)[rail], dict(d.rails_w)[rail])
            pre.append((pw * power_scale, p.seconds / chunk))
            dec.append((dw * power_scale, d.seconds / mix.batch))
    return pre, dec


def ways_of(pre: list[tuple[float, float]], dec: list[tuple[float, float]], mix: Mix) -> list[tuple[float, float]]:
    """(average W, output tokens/s) of every (prefill point, decode point) pair, Pareto only."""
    per_out = mix.prompt / mix.output           # prefill tokens per output token
    ways = []
    for pp, tp in _frontier([(w, -s) for w, s in pre]):
        for pd, td in _frontier([(w, -s) for w, s in dec]):
            t = per_out * -tp + -td
            ways.append(((per_out * -tp * pp + -td * pd) / t, 1.0 / t))
    return _frontier(ways)


def mode_ways(spec: BoardSpec, shape: ModelShape, precision: str, mode: ModeSpec, cores: int | None,
              mix: Mix, power_scale: float = 1.0, rail: str | None = None) -> list[tuple[float, float]]:
    """(average W, output tokens/s) of every (prefill point, decode point) pair in ``mode``, Pareto only."""
    return ways_of(*_points(spec, shape, precision, mode, cores, mix, power_scale, rail), mix)


def choose_config(spec: BoardSpec, shape: ModelShape, precision: str, watts: float, mix: Mix = Mix(),
                  power_scale: float = 1.0, modes: tuple[str, ...] | None = None,
                  rail: str | None = None) -> ConfigChoice:
    """The mode and cores online with the most predicted tokens/s of ``mix`` within ``watts`` (of the board,
    or of ``rail``: see the module docstring); ``modes`` limits the candidates (names), e.g. to those that
    need no reboot."""
    fewest = min(m.online_cores for m in spec.modes)
    opts = []
    for m in spec.modes:
        if modes is not None and m.name not in modes:
            continue
        full = mode_ways(spec, shape, precision, m, m.online_cores, mix, power_scale, rail)
        cores = fewest if full[-1][0] > watts else m.online_cores
        ways = full if cores == m.online_cores else mode_ways(spec, shape, precision, m, cores, mix, power_scale,
                                                              rail)
        opts.append(ConfigOption(m.name, active_tpcs(spec, m.tpc_pg_mask), cores, hull_rate(ways, watts),
                                 ways[0][0], ways[-1][0]))
    if not opts:
        raise ValueError(f"{spec.name}: none of the modes {modes} exists")
    best = max(opts, key=lambda o: (round(o.tokens_per_s, 6), -o.floor_w))
    return ConfigChoice(best.mode, best.cores_online, best.tokens_per_s, tuple(opts))
