"""Wiring a power budget (power.policy.budget) into a control loop: the budget a profile's ``[budget]`` and a
``--power-cap`` override give, the module power read from the rails, installing the budgeted controller on a
:class:`power.applier.PowerLoop` (the service's controller, the energy bench), and the budget's status as a
plain dict for the state file (``power status``) and ``/metrics``.

Module power: the VDD_IN rail where the board has one (Orin NX/Nano: the module's input), else the sum of the
labelled rails (AGX Orin: VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 + VDDQ_VDD2_1V8AO).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from power.applier import PowerLoop
from power.hw.backends import SysfsBoard
from power.policy.budget import Budget, BudgetController, BudgetState
from power.policy.profiles import Profile

DEFAULT_WINDOW_S = 10.0


def budget_for(profile: Profile, power_cap_w: float | None = None) -> Budget | None:
    """The profile's budget, with ``power_cap_w`` (``--power-cap``) replacing its watts (window and peak kept
    where still valid)."""
    b = profile.budget
    if power_cap_w is None:
        return b
    window = b.window_s if b is not None else DEFAULT_WINDOW_S
    peak = b.peak_watts if b is not None and b.peak_watts is not None and b.peak_watts >= power_cap_w else None
    return Budget(power_cap_w, window, peak)


def with_cap(profile: Profile, power_cap_w: float | None) -> Profile:
    """``profile`` with ``--power-cap`` applied to its budget."""
    return dataclasses.replace(profile, budget=budget_for(profile, power_cap_w))


def module_power_reader(board: SysfsBoard) -> Callable[[], float | None]:
    """Module power now, W, from the rails (None when unreadable)."""
    def read() -> float | None:
        rails = [r for r in board.read_rails() if r.label and r.label != "NC" and r.mw is not None]
        vin = [r for r in rails if r.label == "VDD_IN"]
        use = vin or rails
        return sum(r.mw or 0.0 for r in use) / 1000.0 if use else None
    return read


def install(loop: PowerLoop, budget: Budget, power: Callable[[], float | None]) -> BudgetController:
    """Cap ``loop``'s DVFS controller to ``budget``; ``power`` reads the module power at each decision."""
    ctl = BudgetController(loop.controller, budget)
    loop.power = power                                  # type: ignore[assignment]
    loop.controller = ctl                               # type: ignore[assignment]
    loop.state = BudgetState(dvfs=loop.state)           # type: ignore[assignment]
    return ctl


def status_dict(loop: PowerLoop) -> dict[str, float | int | bool] | None:
    """The budget's last status (None: no budget on this loop, or no decision yet)."""
    st = loop.state
    if not isinstance(st, BudgetState) or st.status is None:
        return None
    return dataclasses.asdict(st.status)
