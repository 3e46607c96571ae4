"""What the ``auto`` controller learned from measured steps: per clock point residuals of step time *and*
step power against the cost model, and the corrections they imply at the points never measured.

Used by :mod:`power.policy.dvfs` (its ``auto`` choice and exploration, :mod:`power.policy.autopoint`) and
:mod:`power.policy.budget` (the corrected time of every point). Pure, no I/O.

- A *residual* is log(measured / predicted), the prediction being the cost model's at the size the step
  actually served. Each (phase kind, batch class, GPU Hz, EMC Hz) keeps a running mean and variance of it,
  for time (step seconds) and for power (the rails' board watts during the step, where read): the mean of
  all samples for the first ``1 / ALPHA_MIN``, then an EWMA with weight ``ALPHA_MIN`` (the board drifts with
  temperature; a mean over tens of steps keeps +-5 % step noise to ~0.5 % on the residual). It also keeps
  the model's compute, memory and overhead shares of the step (``parts``).
- Batch classes: a decode step's compute time grows with its rows while its memory time does not, so an
  error in the compute rate shows at batch 8 where batch 1 is memory-bound. Decode rows 1, 2-3, 4-7 and 8+
  are learned apart (1, 2, 4, 8); prefill is one class.
- Time at a point not measured: a *roofline* correction (``power.policy.fitting``: a uniform level and
  multipliers of the model's compute, memory and overhead times, fitted per kernel path: prefill, small-batch
  GEMV decode, tensor-core decode) so that a board whose compute is faster than the model moves the
  compute/memory crossover where the board has it; then a *plane* in (1 - f_gpu / f_gpu_top,
  1 - f_emc / f_emc_top) through what the roofline leaves, pooled over the kind's classes, each class
  shrunk towards the pool. Power: a plane alone. One measured point gives a uniform correction; points
  along one axis give that axis' slope, three off one line both. RESEARCH.md: a GPU-clock-only latency
  model misses by up to 32 % on Orin, so the correction must depend on both clocks.
- At a measured point its own mean counts, shrunk towards the fit by its standard error.
- What is not known yet is carried along: each multiplier's posterior standard deviation, so that
  exploration can ask whether a point *could* be the best (``optimistic`` time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from power.policy.fitting import Plane, Roofline, fit_plane, fit_roofline

ALPHA_MIN = 0.02            # EWMA weight once a point has 1 / ALPHA_MIN samples (a running mean until then)
NOISE_PRIOR = 0.01          # step-to-step noise assumed until some point has NOISE_SAMPLES samples (1 %)
NOISE_SAMPLES = 3
NOISE_MIN = 1e-4            # below this the noise is not resolved (0.01 %)
OWN_NOISE_SAMPLES = 50      # from this many samples a point's own spread is its noise (1 / ALPHA_MIN)
MISFIT = 0.02               # how far a plane may sit from a measured point (the truth is not a plane)
SLOPE_PRIOR = 0.5           # prior std of a slope: the residual may change by ~0.5 in log across an axis
LEVEL_PRIOR = 10.0          # prior std of the level: nearly free (a 20x error everywhere is plausible: a CPU)
CLASS_SLOPE_PRIOR = 0.25    # a batch class' slopes vary this much around the pooled ones
CLASS_LEVEL_PRIOR = 0.1     # ... and its level around the roofline's
MULTIPLIER_PRIOR = 0.3      # prior std of log compute / memory / overhead multipliers (a runtime +-35 % off)
OPTIMISM = 2.0              # prior deviations a multiplier no measurement pinned down may be faster (exploration)
ZERO = (0.0, 0.0, 0.0, 0.0)
DECODE_CLASSES = (1, 2, 4, 8)

Key = tuple[str, int, int, int]         # (phase kind, batch class, GPU Hz, EMC Hz)


def batch_class(kind: str, batch: int) -> int:
    """Decode: rows rounded down to 1, 2, 4 or 8 (tensor cores from 8 rows on); prefill: 0."""
    if kind != "decode":
        return 0
    return max(c for c in DECODE_CLASSES if c <= max(1, batch))


@dataclass(frozen=True)
class Residual:
    """Running mean and variance of one log residual."""
    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def add(self, x: float) -> "Residual":
        n = self.n + 1
        a = max(1.0 / n, ALPHA_MIN)
        d = x - self.mean
        return Residual(n, self.mean + a * d, (1 - a) * (self.var + a * d * d))

    def se(self, noise_var: float) -> float:
        """Standard error of the mean over the samples it effectively averages: of this point's own variance
        once it has ``OWN_NOISE_SAMPLES``, before that the larger of its and the kind's noise. (The kind's
        pools every batch class, whose residuals also vary with the rows a step serves: on a sampled board,
        bench power --boards 16 board 7, that put a 0.4 % error on a decode point measured 16 000 times at a
        0.01 % spread, and the hysteresis kept it 1 % past the TPOT limit.)"""
        if self.n == 0:
            return math.inf
        n_eff = min(self.n, (2 - ALPHA_MIN) / ALPHA_MIN)
        var = self.var if self.n >= OWN_NOISE_SAMPLES else max(self.var, noise_var)
        return math.sqrt(max(var, NOISE_MIN ** 2) / n_eff)


Parts = tuple[float, float, float]      # the model's compute, memory, overhead seconds / its step seconds


@dataclass(frozen=True)
class PointStats:
    time: Residual = Residual()
    power: Residual = Residual()
    parts: Parts = (0.0, 0.0, 0.0)          # running mean over the samples

    def add(self, log_time: float, log_power: float | None, parts: Parts) -> "PointStats":
        t = self.time.add(log_time)
        a = max(1.0 / t.n, ALPHA_MIN)
        mixed = tuple(old + a * (new - old) for old, new in zip(self.parts, parts))
        return PointStats(t, self.power if log_power is None else self.power.add(log_power), mixed)  # type: ignore[arg-type]


def path_of(kind: str, cls: int) -> str:
    """The kernel path whose roofline multipliers a class shares: prefill, GEMV decode, tensor-core decode."""
    return kind if kind != "decode" else ("gemm" if cls >= DECODE_CLASSES[-1] else "gemv")


@dataclass(frozen=True)
class Correction:
    """What was learned at one point: log residuals of time and power, how uncertain each still is (0
    where the point is not measured: the plane's own error is what exploration is for), and the samples."""
    log_time: float
    log_power: float
    sd_time: float
    sd_power: float
    samples: int
    log_time_optimistic: float          # were each multiplier not pinned down OPTIMISM prior deviations faster


@dataclass(frozen=True)
class Surface:
    """The corrections of one phase kind and batch class at any point."""
    roofline: Roofline
    time: Plane                 # what the roofline leaves
    power: Plane
    own: Mapping[tuple[int, int], PointStats]       # this class' measured points
    gpu_top: int
    emc_top: int
    noise_var: float

    def _blend(self, plane_value: float, r: Residual) -> tuple[float, float]:
        """A measured mean shrunk towards the plane by its standard error (one noisy sample moves the
        estimate less than a settled mean of many), and the blend's standard deviation."""
        if not r.n:
            return plane_value, 0.0
        w_own = 1.0 / r.se(self.noise_var) ** 2
        w_plane = 1.0 / MISFIT ** 2
        return (plane_value * w_plane + r.mean * w_own) / (w_plane + w_own), 1.0 / math.sqrt(w_own + w_plane)

    def at(self, g: int, e: int, parts: Parts) -> Correction:
        """The corrections at (g, e) for a step whose model parts are ``parts``."""
        u = 1 - g / self.gpu_top if self.gpu_top else 0.0
        w = 1 - e / self.emc_top if self.emc_top else 0.0
        plane = self.time.at(u, w)
        lt0 = self.roofline.at(parts) + plane
        s = self.own.get((g, e))
        if s is None:
            opt = self.roofline.at(parts, optimistic=True) + plane
            return Correction(lt0, self.power.at(u, w), 0.0, 0.0, 0, opt)
        lt, st = self._blend(lt0, s.time)
        lp, sp = self._blend(self.power.at(u, w), s.power)
        return Correction(lt, lp, st, sp, s.time.n, lt)


@dataclass(frozen=True)
class Learned:
    """Every measured point's residuals; the table tops the surface is laid out on."""
    points: Mapping[Key, PointStats] = field(default_factory=lambda: MappingProxyType({}))
    gpu_top: int = 0
    emc_top: int = 0
    hints: Mapping[tuple[str, str], tuple[float, float, float, float]] = field(
        default_factory=lambda: MappingProxyType({}))      # the last roofline fits: where the next one starts
    _surfaces: dict[tuple[str, int], Surface] = field(default_factory=dict, init=False, compare=False, hash=False,
                                                      repr=False)

    def add(self, kind: str, batch: int, gpu_hz: int, emc_hz: int, log_time: float,
            log_power: float | None, parts: Parts) -> "Learned":
        key = (kind, batch_class(kind, batch), gpu_hz, emc_hz)
        new = self.points.get(key, PointStats()).add(log_time, log_power, parts)
        hints = {**self.hints, **{(k, path_of(k, c)): s.roofline.theta for (k, c), s in self._surfaces.items()}}
        return Learned(MappingProxyType({**self.points, key: new}), self.gpu_top, self.emc_top, MappingProxyType(hints))

    def noise_var(self, kind: str) -> float:
        """The kind's step-to-step noise: the mean variance of its points with a few samples."""
        vs = [s.time.var for (k, _, _, _), s in self.points.items() if k == kind and s.time.n >= NOISE_SAMPLES]
        return sum(vs) / len(vs) if vs else NOISE_PRIOR ** 2

    def surface(self, kind: str, batch: int) -> Surface:
        """The corrections for ``kind`` at ``batch`` rows (memoised: this object never changes)."""
        cls = batch_class(kind, batch)
        hit = self._surfaces.get((kind, cls))
        if hit is None:
            hit = self._surfaces[(kind, cls)] = self._fit(kind, cls)
        return hit

    def _fit(self, kind: str, cls: int) -> Surface:
        nv = self.noise_var(kind)
        mine = {key: s for key, s in self.points.items() if key[0] == kind}
        own = MappingProxyType({(g, e): s for (_, c, g, e), s in mine.items() if c == cls})

        def uw(g: int, e: int) -> tuple[float, float]:
            return (1 - g / self.gpu_top if self.gpu_top else 0.0), (1 - e / self.emc_top if self.emc_top else 0.0)

        def weight(r: Residual) -> float:
            return 1.0 / (r.se(nv) ** 2 + MISFIT ** 2)

        def roofline(path: str) -> Roofline:
            obs = [(s.parts, s.time.mean, weight(s.time)) for (_, c, _, _), s in mine.items()
                   if s.time.n and path_of(kind, c) == path]
            return fit_roofline(obs, LEVEL_PRIOR, MULTIPLIER_PRIOR, OPTIMISM, self.hints.get((kind, path), ZERO))

        path = path_of(kind, cls)
        roofs = {p: roofline(p) for p in {path, *(path_of(kind, c) for (_, c, _, _) in mine)}}
        roof = roofs[path]
        # the plane takes what the roofline of each point's own path leaves
        def left(keys: list[Key]) -> list[tuple[float, float, float, float]]:
            return [(*uw(g, e), mine[(k, c, g, e)].time.mean - roofs[path_of(kind, c)].at(mine[(k, c, g, e)].parts),
                     weight(mine[(k, c, g, e)].time)) for (k, c, g, e) in keys if mine[(k, c, g, e)].time.n]

        def powers(keys: list[Key]) -> list[tuple[float, float, float, float]]:
            return [(*uw(g, e), mine[key].power.mean, weight(mine[key].power)) for key in keys
                    for (_, _, g, e) in (key,) if mine[key].power.n]

        keys = list(mine)
        mine_cls = [k for k in keys if k[1] == cls]
        pooled_t = fit_plane(left(keys), Plane(), (1e-3, SLOPE_PRIOR, SLOPE_PRIOR))
        time = fit_plane(left(mine_cls), pooled_t, (CLASS_LEVEL_PRIOR, CLASS_SLOPE_PRIOR, CLASS_SLOPE_PRIOR))
        pooled_p = fit_plane(powers(keys), Plane(), (LEVEL_PRIOR, SLOPE_PRIOR, SLOPE_PRIOR))
        power = fit_plane(powers(mine_cls), pooled_p, (LEVEL_PRIOR, CLASS_SLOPE_PRIOR, CLASS_SLOPE_PRIOR)) \
            if powers(mine_cls) else pooled_p
        return Surface(roof, time, power, own, self.gpu_top, self.emc_top, nv)
