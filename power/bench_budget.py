"""The power-budget benchmark: under a cap of W watts, the budgeted controller beside the nvpmodel mode of
that wattage under the stock governors, over the same seeded trace, each on a fresh twin tree, driven by
an engine (agent.benchpower's scheduler driver from the CLI; power.bench.simple_driver in tests).

Per policy the energy bench's record (power.bench.PolicyResult) plus: output tokens per second of the
whole run, per-stream decode speed (1 / p50 time per output token), the maximum sliding-window average
board power over every ``measure_window_s`` window (and over every window of the controller's own
``window_s``), the cap and, for the capped run, how many plans could not meet the budget even at the floor.

The nvpmodel mode of a wattage: the mode whose name carries the largest wattage at or below the cap
(``MODE_15W`` for 15 and 20 W on AGX Orin, ``MODE_30W`` for 30 W; ``7W`` / ``15W`` on Orin Nano).
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from power.applier import PowerLoop
from power.bench import AUTO_DOC, BenchConfig, Driver, _tmp_base, result, simple_driver
from power.bench_run import MODE_PREFIX, PolicyRun
from power.physics.boards import BoardSpec, board_for
from power.policy.budget import Budget, BudgetController, BudgetState
from power.policy.profiles import ProfileStore
from power.traces import make_trace

MEASURE_WINDOW_S = 60.0         # the window the objective is measured over
CAP_BASE_PROFILE = "balanced"   # the profile the budget caps (its latency targets: near full speed)


def mode_watts(name: str) -> float | None:
    """Rated watts in an nvpmodel mode's name (``MODE_15W``, ``7W``, ``MAXN_SUPER`` -> None)."""
    m = re.search(r"(\d+(?:\.\d+)?)W$", name)
    return float(m.group(1)) if m else None


def mode_for_cap(spec: BoardSpec, watts: float) -> str | None:
    """The nvpmodel mode named with the largest wattage at or below ``watts`` (None if none is)."""
    rated = [(w, m.name) for m in spec.modes if (w := mode_watts(m.name)) is not None and w <= watts + 1e-9]
    return max(rated)[1] if rated else None


def capped_name(watts: float) -> str:
    return f"cap-{watts:g}W"


def max_window_average(log: list[tuple[float, float]], window_s: float) -> float:
    """Largest average power over any window of ``window_s`` inside the log of (t, cumulative joules)."""
    import numpy as np

    if len(log) < 2:
        return float("nan")
    t = np.array([p[0] for p in log])
    e = np.array([p[1] for p in log])
    if t[-1] - t[0] < window_s:
        return float((e[-1] - e[0]) / max(t[-1] - t[0], 1e-9))
    ends = t[t >= t[0] + window_s]
    starts = np.interp(ends - window_s, t, e)
    return float(np.max((np.interp(ends, t, e) - starts) / window_s))


def install_budget(loop: PowerLoop, budget: Budget) -> BudgetController:
    """Cap ``loop``'s DVFS controller to ``budget`` (the loop must read power: ``loop.power``)."""
    ctl = BudgetController(loop.controller, budget)
    loop.controller = ctl              # type: ignore[assignment]
    loop.state = BudgetState(dvfs=loop.state)    # type: ignore[assignment]
    return ctl


def run_budget_bench(cfg: BenchConfig, watts: float, driver: Driver = simple_driver, *, window_s: float = 10.0,
                     measure_window_s: float = MEASURE_WINDOW_S, peak_watts: float | None = None) -> list[dict[str, Any]]:
    """The nvpmodel mode of ``watts`` (stock governors), then the budgeted controller; plus ``cfg.policies``."""
    spec = board_for(cfg.board, cfg.l4t)
    budget = Budget(watts, window_s, peak_watts)
    mode = mode_for_cap(spec, watts)
    policies = [*([MODE_PREFIX + mode] if mode else []), capped_name(watts), *cfg.policies]
    trace = make_trace(cfg.trace, cfg.duration_s, cfg.seed)
    store = ProfileStore(cfg.profile_dir)
    rows = []
    for policy in policies:
        capped = policy == capped_name(watts)
        profile = None
        if capped:
            profile = store.load(CAP_BASE_PROFILE)
        elif not policy.startswith(MODE_PREFIX) and policy not in ("maxn+jetson_clocks", "stock-maxn", "stock-default"):
            profile = store.load_doc("auto", AUTO_DOC) if policy == "auto" else store.load(policy)
        with tempfile.TemporaryDirectory(prefix="orin-bench-", dir=_tmp_base()) as d:
            run = PolicyRun(cfg.board, cfg.l4t, cfg.shape, cfg.precision, policy, Path(d),
                            ambient_c=cfg.ambient_c, fan=cfg.fan, profile=profile)
            ctl = None
            if capped:
                assert run.loop is not None
                run.loop.power = lambda: run.twin.state.power.board_w
                ctl = install_budget(run.loop, budget)
            try:
                res = result(run, driver(run, trace, cfg), len(trace), cfg.duration_s)
            finally:
                run.close()
        row = res.record() | {
            "power_cap_w": watts if capped else None,
            "nvpmodel_mode": policy[len(MODE_PREFIX):] if policy.startswith(MODE_PREFIX) else (
                profile.nvpmodel if profile else None),
            "tokens_per_s": res.output_tokens / res.duration_s,
            "decode_tok_s_per_stream": 1.0 / res.tpot_p50_s if res.tpot_p50_s > 0 else None,
            "max_window_avg_w": max_window_average(run.energy_log, measure_window_s),
            "measure_window_s": measure_window_s,
            "max_window_avg_control_w": max_window_average(run.energy_log, window_s),
            "control_window_s": window_s,
        }
        if ctl is not None:
            st = run.loop.state if run.loop is not None else None
            status = st.status if isinstance(st, BudgetState) else None
            row |= {"budget_unmet_plans": status.unmet_decisions if status else 0,
                    "budget_capped_plans": status.capped_decisions if status else 0}
        rows.append(row)
    _ratios(rows, watts)
    return rows


def _ratios(rows: list[dict[str, Any]], watts: float) -> None:
    """tok/s and average power of the capped row over the nvpmodel row's."""
    base = next((r for r in rows if str(r["policy"]).startswith(MODE_PREFIX)), None)
    cap = next((r for r in rows if r["policy"] == capped_name(watts)), None)
    if base is None or cap is None:
        return
    cap["vs_nvpmodel"] = {
        "mode": base["nvpmodel_mode"],
        "tokens_per_s_x": cap["tokens_per_s"] / base["tokens_per_s"],
        "decode_tok_s_per_stream_x": (cap["decode_tok_s_per_stream"] / base["decode_tok_s_per_stream"]
                                      if cap["decode_tok_s_per_stream"] and base["decode_tok_s_per_stream"] else None),
        "mean_power_w_delta": cap["mean_power_w"] - base["mean_power_w"],
    }
