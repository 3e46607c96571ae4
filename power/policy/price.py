"""The power budget's price: how the budget trades step time for power the way the equal-power ceiling
(``power.policy.powerconfig``) does, and the feedback that keeps it at the budget's watts.

Most tokens per second at an average power of at most ``W`` is a linear program over the time each
(phase, clock point) runs; its Lagrangian prices power at ``lam`` (1/W): every step, alone, runs at the point of
least ``seconds x (1 + lam x (watts - W))``, and at the price where two points tie the controller time-shares
them. That is the rule that builds the ceiling's hull (the ways of serving the mix on its upper concave hull are
exactly these per-phase choices), so a controller that picks by the price at the hull's own tie (:func:`hull_price`)
runs the ceiling's operating points, and the share of time at each of the two tied ways comes from the feedback.

Feedback (:func:`price_at`): ``lam = hull x exp(-headroom / (PRICE_SPAN x W x window))``, headroom the
joules the trailing window has left under ``W x window`` (its average over the part seen before a full window
has passed): energy the window has left lowers the price (the next steps may spend it), a window at or over
its limit raises it (the next steps save). The window's hard limit stays with the budget's guard
(``power.policy.budget.allowed_power``): the price picks, the guard only vetoes. A slow integrator of the
reference price was tried and dropped: the guard's vetoes keep the window's headroom just above zero, so an
integrator of it only winds the price down (docs/BENCHMARKS.md, the power budget). Pure, no I/O, torch-free.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

__all__ = ["PRICE_SPAN", "hull_price", "pareto_front", "price_at", "price_cost", "upper_hull"]

PRICE_SPAN = 0.1            # headroom of this fraction of a window's energy moves the price by a factor e


def pareto_front(items: Iterable[T], power: Callable[[T], float], speed: Callable[[T], float]) -> list[T]:
    """The items no other item beats on both power and speed, by rising power (each faster than the last)."""
    out: list[T] = []
    for c in sorted(items, key=lambda c: (power(c), -speed(c))):
        if not out or speed(c) > speed(out[-1]):
            out.append(c)
    return out


def upper_hull(ways: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (W, rate) ways on the upper concave hull, by rising power (what time-sharing two ways reaches)."""
    hull: list[tuple[float, float]] = []
    for p in pareto_front(ways, power=lambda w: w[0], speed=lambda w: w[1]):
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  <= (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    return hull


def hull_price(ways: Iterable[tuple[float, float]], watts: float) -> float:
    """The price (1/W) at which the two hull ways around ``watts`` cost alike per output token:
    ``(1 + lam (P1 - W)) / r1 == (1 + lam (P2 - W)) / r2``. 0 when the fastest way fits (nothing to trade);
    the hull's first segment's price when even the least-power way draws more than ``watts``."""
    hull = upper_hull(ways)
    if not hull:
        raise ValueError("no ways to price")
    if hull[-1][0] <= watts:
        return 0.0
    if len(hull) == 1:
        return 1.0 / max(hull[0][0] - watts, 1e-9) if hull[0][0] > watts else 0.0
    i = next((k for k in range(1, len(hull)) if hull[k][0] > watts), len(hull) - 1)
    (p1, r1), (p2, r2) = hull[i - 1], hull[i]
    den = r1 * (p2 - watts) - r2 * (p1 - watts)
    return max(0.0, (r2 - r1) / den) if den > 0 else 0.0


def price_cost(seconds: float, watts: float, budget_w: float, lam: float) -> float:
    """What a step at a point costs at price ``lam``: its time, plus ``lam`` x its energy over the budget's."""
    return seconds * (1.0 + lam * (watts - budget_w))


def price_at(ref: float, headroom_j: float, budget_w: float, window_s: float) -> float:
    """The price now: the reference (the hull's), lowered while the window has energy left, raised while it is over."""
    x = -headroom_j / (PRICE_SPAN * budget_w * window_s)
    return ref * math.exp(max(-30.0, min(30.0, x)))
