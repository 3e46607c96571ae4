"""The power cap: the budget (power.policy.budget) a profile's ``[budget]`` and a ``--power-cap`` override
give, installing the budgeted controller on a :class:`power.runtime.loop.PowerLoop` (the service's
controller, the energy bench; the power it reads comes from power.runtime.meter), and the budget's status as a
plain dict for the state file (``power status``) and ``/metrics``.

The power configuration (:func:`budget_config`): the nvpmodel mode and the CPU cores online the budget runs
under (``power.policy.powerconfig``), chosen when the session opens; a mode that would change the TPC mask
(a reboot) is only taken with ``--allow-reboot-modes``, else the best mode without a reboot, with a note.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from power.runtime.applier import ClockApplier
from power.runtime.loop import PowerLoop
from power.physics.boards import BoardSpec
from power.physics.costmodel import ModelShape
from power.policy.powerconfig import Mix, choose_config
from power.policy.budget import Budget, BudgetController, BudgetState
from power.policy.profiles import Profile
from power.runtime.shapes import model_shape

DEFAULT_WINDOW_S = 10.0
DEFAULT_SHAPE = "llama-3-8b"        # the model the configuration is chosen for when none is given (power set)
CHOOSE_MODES = (None, "max")        # profile modes the budget may replace (an explicit mode stands)


def budget_for(profile: Profile, power_cap_w: float | None = None) -> Budget | None:
    """The profile's budget, with ``power_cap_w`` (``--power-cap``) replacing its watts (window and peak kept
    where still valid)."""
    b = profile.budget
    if power_cap_w is None:
        return b
    window = b.window_s if b is not None else DEFAULT_WINDOW_S
    peak = b.peak_watts if b is not None and b.peak_watts is not None and b.peak_watts >= power_cap_w else None
    return Budget(power_cap_w, window, peak, b.rail if b is not None else None)


def with_cap(profile: Profile, power_cap_w: float | None) -> Profile:
    """``profile`` with ``--power-cap`` applied to its budget."""
    return dataclasses.replace(profile, budget=budget_for(profile, power_cap_w))


def install(loop: PowerLoop, budget: Budget, power: Callable[[], float | None],
            mix: Mix | None = None, cores_online: int | None = None) -> BudgetController:
    """Cap ``loop``'s DVFS controller to ``budget``; ``power`` reads the module power at each decision; ``mix``:
    the requests the budget's price is set for (power.policy.price), with ``cores_online`` (None: every core)."""
    ctl = BudgetController(loop.controller, budget, mix, cores_online)
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


def budget_config(applier: ClockApplier, spec: BoardSpec, profile: Profile, shape: ModelShape | None,
                  precision: str, allow_reboot: bool, mix: Mix | None = None) -> tuple[str | None, int]:
    """(the mode to switch to, the CPU cores to keep online) for ``profile``'s budget; notes the choice on
    ``applier``. The profile's own mode stands where it names one (not ``max``)."""
    assert profile.budget is not None
    watts, rail = profile.budget.watts, profile.budget.rail
    if rail is not None and rail not in {r.label for r in spec.rails}:
        raise ValueError(f"budget rail {rail!r}: {spec.name} has "
                         f"{', '.join(r.label for r in spec.rails if r.label != 'NC')} (leave rail out for module power)")
    resolved = shape if shape is not None else model_shape(DEFAULT_SHAPE)
    mix = mix or Mix()
    nvp = applier.board.nvpmodel
    if profile.nvpmodel not in CHOOSE_MODES or not nvp.available:
        # an explicit mode, or no nvpmodel.conf to switch: the mode stands, only the cores are chosen for it
        conf_mode = nvp.conf().resolve(profile.nvpmodel) if nvp.available and profile.nvpmodel else None
        name = conf_mode.name if conf_mode is not None else None
        names = tuple(m.name for m in spec.modes if m.name == name)
        choice = choose_config(spec, resolved, precision, watts, mix, modes=names or None, rail=rail)
        return profile.nvpmodel, choice.cores_online
    conf = nvp.conf()
    choice = choose_config(spec, resolved, precision, watts, mix, rail=rail,
                           modes=tuple(m.name for m in spec.modes if conf.resolve(m.name) is not None) or None)
    live = applier.tpc_mask_in_force()
    mask = conf.resolve(choice.mode)
    new = mask.value("TPC_POWER_GATING", "TPC_PG_MASK") if mask is not None else None
    if not allow_reboot and live is not None and new is not None and live.strip() != new.strip():
        same = tuple(m.name for m in conf.modes
                     if (m.value("TPC_POWER_GATING", "TPC_PG_MASK") or "").strip() == live.strip()
                     and any(s.name == m.name for s in spec.modes))
        if same:
            applier.note(f"{choice.summary(watts)}; {choice.mode} changes the TPC mask (a reboot): "
                         f"pass --allow-reboot-modes to take it")
            choice = choose_config(spec, resolved, precision, watts, mix, modes=same, rail=rail)
    applier.note(choice.summary(watts) + ("" if shape else f" (for {DEFAULT_SHAPE} {precision})"))
    return choice.mode, choice.cores_online
