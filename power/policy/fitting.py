"""The small fits behind the learned corrections (:mod:`power.policy.learn`): a roofline of three
multipliers (compute, memory, overhead) and a plane over the two clocks, each by weighted least squares
with a Gaussian prior (ridge), solved in closed form or by a few Gauss-Newton steps. Pure numerics, no
dependencies (the power half stays torch- and numpy-free).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

CROSSOVER_SHARPNESS = 30.0  # compute and memory times 5 % apart: 81 / 19 % of a measurement to the larger
IDENTIFIED_SHARE = 0.9      # a part is pinned down by a point it bounds with this share (7 % clear of the other)
IDENTIFIED_OVERHEAD = 0.1   # the overhead multiplier by a point where overhead is a tenth of the step


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are small and positive definite)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        for r in range(i + 1, n):
            f = m[r][i] / m[i][i]
            for c in range(i, n + 1):
                m[r][c] -= f * m[i][c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][c] * x[c] for c in range(i + 1, n))) / m[i][i]
    return x


def ridge(rows: Sequence[tuple[Sequence[float], float, float]], prior: Sequence[float],
          prior_sd: Sequence[float]) -> tuple[list[float], list[list[float]]]:
    """Weighted least squares of (features, y, weight) rows with a N(prior, prior_sd^2) prior per
    coefficient: (coefficients, the normal matrix)."""
    n = len(prior)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for i in range(n):
        a[i][i] = 1.0 / prior_sd[i] ** 2
        b[i] = prior[i] / prior_sd[i] ** 2
    for f, y, wt in rows:
        for i in range(n):
            b[i] += wt * f[i] * y
            for j in range(n):
                a[i][j] += wt * f[i] * f[j]
    return solve(a, b), a


@dataclass(frozen=True)
class Roofline:
    """log(time / model time) = level + log(max(kc x c, km x m) + ko x o), where (c, m, o) are the model's
    compute, memory and overhead times as fractions of its step time; ``theta`` = (level, log kc, log km,
    log ko). ``identified``: which multipliers some measured point pins down (it is clearly bound by that
    part); ``optimistic``: the multipliers with each one not pinned down ``shift`` prior deviations faster."""
    theta: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    identified: tuple[bool, bool, bool] = (False, False, False)
    optimistic: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def at(self, parts: tuple[float, float, float], optimistic: bool = False) -> float:
        """The log residual at a point with those parts (the optimistic one: faster where not known)."""
        c, m, o = parts
        kc, km, ko = self.optimistic if optimistic else (math.exp(self.theta[1]), math.exp(self.theta[2]),
                                                          math.exp(self.theta[3]))
        return self.theta[0] + math.log(max(kc * c, km * m) + ko * o)


def _grad(theta: Sequence[float], parts: tuple[float, float, float]) -> tuple[float, list[float]]:
    """The roofline's log residual at ``parts`` and its gradient in theta."""
    c, m, o = parts
    kc, km, ko = math.exp(theta[1]), math.exp(theta[2]), math.exp(theta[3])
    bound = max(kc * c, km * m)
    t = bound + ko * o
    # which part bounds the step: near the crossover a measurement cannot tell, so its weight is split
    # (a soft maximum's weights; the value stays the hard maximum the cost model uses)
    r = (km * m) / (kc * c) if kc * c > 0 else math.inf
    share_c = 1.0 / (1.0 + r ** CROSSOVER_SHARPNESS) if r < 1e6 else 0.0
    return theta[0] + math.log(t), [1.0, share_c * bound / t, (1 - share_c) * bound / t, ko * o / t]


def fit_roofline(obs: Sequence[tuple[tuple[float, float, float], float, float]], level_sd: float,
                 coef_sd: float, shift: float, start: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
                 iters: int = 8) -> Roofline:
    """Gauss-Newton on (parts, log residual, weight) observations from ``start`` (the last fit: one or two
    steps then). The level takes what is uniform (its prior is wide), the multipliers what depends on
    which part bounds a point (their prior is ``coef_sd``); ``shift``: the optimistic deviations."""
    theta = list(start)                             # level, log kc, log km, log ko
    prior_sd = [level_sd, coef_sd, coef_sd, coef_sd]
    for _ in range(iters):
        rows = []
        for parts, y, wt in obs:
            pred, grad = _grad(theta, parts)
            # linearised: y - pred + grad . theta = grad . theta_new
            rows.append((grad, y - pred + sum(g * v for g, v in zip(grad, theta)), wt))
        new, _ = ridge(rows, [0.0] * 4, prior_sd)
        done = max(abs(a - b) for a, b in zip(new, theta)) < 1e-6
        theta = new
        if done:
            break
    grads = [_grad(theta, parts)[1] for parts, _, _ in obs]
    known = (any(g[1] >= IDENTIFIED_SHARE * (g[1] + g[2]) > 0 for g in grads),
             any(g[2] >= IDENTIFIED_SHARE * (g[1] + g[2]) > 0 for g in grads),
             any(g[3] >= IDENTIFIED_OVERHEAD for g in grads))
    opt = tuple(math.exp(k - (0.0 if kn else shift * coef_sd)) for k, kn in zip(theta[1:], known))
    return Roofline((theta[0], theta[1], theta[2], theta[3]), known, opt)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Plane:
    """log residual = level + a_gpu x (1 - f/f_top) + a_emc x (1 - e/e_top)."""
    coef: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def at(self, u: float, w: float) -> float:
        return self.coef[0] + self.coef[1] * u + self.coef[2] * w


def fit_plane(obs: Sequence[tuple[float, float, float, float]], prior: Plane,
              prior_sd: tuple[float, float, float]) -> Plane:
    """Ridge fit of (u, w, y, weight) observations, shrunk towards ``prior`` with ``prior_sd`` per coefficient."""
    coef, _ = ridge([((1.0, u, w), y, wt) for u, w, y, wt in obs], prior.coef, prior_sd)
    return Plane((coef[0], coef[1], coef[2]))
