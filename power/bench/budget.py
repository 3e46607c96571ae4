"""The power-budget benchmark: under a cap of W watts, the budgeted controller beside the nvpmodel mode of
that wattage under the stock governors, over the same seeded trace, each on a fresh twin tree, driven by
an engine (agent.benchmark.power_replay's scheduler driver from the CLI; power.bench.energy.simple_driver in tests).

Per policy the energy bench's record (power.bench.energy.PolicyResult) plus: output tokens per second of the
whole run, per-stream decode speed (1 / p50 time per output token), the maximum sliding-window average
board power over every ``measure_window_s`` window (and over every window of the controller's own
``window_s``), the mean power of each INA3221 rail, the nvpmodel mode and CPU cores online the run served
under, the cap and, for the capped run, the budget's configuration choice and how many plans could not meet
the budget even at the floor. With a budget ``rail``, that rail's mean and window averages too.

The nvpmodel mode of a wattage: the mode whose name carries the largest wattage at or below the cap
(``MODE_15W`` for 15 and 20 W on AGX Orin, ``MODE_30W`` for 30 W; ``7W`` / ``15W`` on Orin Nano).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

from power.bench.energy import AUTO_DOC, BenchConfig, Driver, _tmp_base, result, simple_driver
from power.bench.run import BASELINES, MODE_PREFIX, PolicyRun
from power.physics.boards import BoardSpec, board_for
from power.physics.costmodel import PRECISIONS
from power.physics.exitcost import parse_exit_rates
from power.policy.budget import Budget, BudgetState
from power.policy.powerconfig import Mix
from power.policy.profiles import ProfileStore
from power.runtime.shapes import model_shape
from power.bench.traces import TRACES, Request, make_trace

MEASURE_WINDOW_S = 60.0         # the window the objective is measured over
ISO_MEAN_RUNS = 3               # runs spent finding the cap whose run averages the nvpmodel row's mean
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


def run_budget_bench(cfg: BenchConfig, watts: float, driver: Driver = simple_driver, *, window_s: float = 10.0,
                     measure_window_s: float = MEASURE_WINDOW_S, peak_watts: float | None = None,
                     iso_power: bool = True, rail: str | None = None) -> list[dict[str, Any]]:
    """The nvpmodel mode of ``watts`` (stock governors), the budgeted controller at ``watts`` and, with
    ``iso_power`` when the mode averaged clearly less than ``watts``, the controller capped at the mode's
    own average power (``-iso``: every window at that mean, so its own mean comes out lower) and, where that
    mean is more than 1.5 % lower, the cap whose run averages the mode's mean (``-iso-mean``: the
    equal-average-power comparison); then ``cfg.policies``. ``rail``: budget that INA3221
    rail instead of module power (every row then also reports its window averages on that rail, and the
    iso row caps the rail at the mode's own mean on it)."""
    try:
        spec = board_for(cfg.board, cfg.l4t)
        model_shape(cfg.shape)
    except KeyError as exc:                     # the message names the valid boards / shapes
        raise ValueError(str(exc.args[0])) from None
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; allowed: {', '.join(PRECISIONS)}")
    mode = mode_for_cap(spec, watts)
    trace = make_trace(cfg.trace, cfg.duration_s, cfg.seed)
    store = ProfileStore(cfg.profile_dir)
    if rail is not None and rail not in {r.label for r in spec.rails if r.label != "NC"}:
        raise ValueError(f"budget rail {rail!r}: {spec.name} has "
                         f"{', '.join(r.label for r in spec.rails if r.label != 'NC')}")
    rows = []
    if mode is not None:
        rows.append(_run_one(cfg, MODE_PREFIX + mode, trace, store, None, driver, measure_window_s, window_s, rail))
    rows.append(_run_one(cfg, capped_name(watts), trace, store, Budget(watts, window_s, peak_watts, rail), driver,
                         measure_window_s, window_s, rail))
    mean_key = "mean_power_w" if rail is None else "mean_rail_w"
    if iso_power and rows[0]["policy"] != capped_name(watts) and rows[0][mean_key] < 0.97 * watts:
        target = rows[0][mean_key]
        iso = math.floor(target * 10) / 10
        rows.append(_run_one(cfg, capped_name(iso) + "-iso", trace, store, Budget(iso, window_s, peak_watts, rail),
                             driver, measure_window_s, window_s, rail))
        best = _iso_mean(cfg, trace, store, driver, measure_window_s, window_s, rail, peak_watts, mean_key, target,
                         iso, rows[-1])
        if best is not None:
            rows.append(best)
    for policy in cfg.policies:
        rows.append(_run_one(cfg, policy, trace, store, None, driver, measure_window_s, window_s, rail))
    _ratios(rows)
    return rows


def _iso_mean(cfg: BenchConfig, trace: tuple[Request, ...], store: ProfileStore, driver: Driver,
              measure_window_s: float, window_s: float, rail: str | None, peak_watts: float | None, mean_key: str,
              target: float, lo_cap: float, lo_row: dict[str, Any]) -> dict[str, Any] | None:
    """A cap whose run *averages* the nvpmodel row's mean power (a window cap at that mean averages less: the
    stock run's own windows go above its mean): up to ISO_MEAN_RUNS runs, proportional then bisecting; the
    run with the highest mean at or below the target (+0.5 %), or None when the first iso run was close."""
    best, hi_cap = None, None
    lo_mean = lo_row[mean_key]
    for _ in range(ISO_MEAN_RUNS):
        if lo_mean >= 0.985 * target:
            break
        cap = lo_cap * target / lo_mean if hi_cap is None else (lo_cap + hi_cap) / 2
        cap = round(cap, 2)
        if cap <= lo_cap or (hi_cap is not None and cap >= hi_cap):
            break
        row = _run_one(cfg, capped_name(cap) + "-iso-mean", trace, store, Budget(cap, window_s, peak_watts, rail),
                       driver, measure_window_s, window_s, rail)
        if row[mean_key] <= 1.005 * target:
            best, lo_cap, lo_mean = row, cap, row[mean_key]
        else:
            hi_cap = cap
    return best


def _run_one(cfg: BenchConfig, policy: str, trace: tuple[Request, ...], store: ProfileStore, budget: Budget | None,
             driver: Driver, measure_window_s: float, window_s: float, rail: str | None = None) -> dict[str, Any]:
    profile, mix = None, None
    if budget is not None:      # the base profile; the budget chooses the mode and the cores online for the trace's mix
        profile = dataclasses.replace(store.load(CAP_BASE_PROFILE), nvpmodel="max", budget=budget)
        shape = TRACES[cfg.trace]
        mix = Mix(shape.prompt_median, shape.out_median, cfg.max_batch)
    elif not policy.startswith(MODE_PREFIX) and policy not in BASELINES:
        profile = store.load_doc("auto", AUTO_DOC) if policy == "auto" else store.load(policy)
    with tempfile.TemporaryDirectory(prefix="orin-bench-", dir=_tmp_base()) as d:
        run = PolicyRun(cfg.board, cfg.l4t, cfg.shape, cfg.precision, policy, Path(d),
                        ambient_c=cfg.ambient_c, fan=cfg.fan, profile=profile, mix=mix,
                        exits=parse_exit_rates(cfg.exit_rates) if cfg.exit_rates else None, exit_gate=cfg.exit_gate)
        try:
            res = result(run, driver(run, trace, cfg), len(trace), cfg.duration_s)
            mode = run.board.read_mode()
            cores = sum(len(c.online) for c in run.board.cpu.read())
            notes = list(run.loop.applier.notes) if run.loop is not None and run.loop.applier is not None else []
        finally:
            run.close()
    row = res.record() | {
        "nvpmodel_mode": mode.name if mode is not None else None,
        "cores_online": cores,
        "tokens_per_s": res.output_tokens / res.duration_s,
        "decode_tok_s_per_stream": 1.0 / res.tpot_p50_s if res.tpot_p50_s > 0 else None,
        "max_window_avg_w": max_window_average(run.energy_log, measure_window_s),
        "measure_window_s": measure_window_s,
        "max_window_avg_control_w": max_window_average(run.energy_log, window_s),
        "control_window_s": window_s,
    }
    t_end, js = run.rail_log[-1]
    row["mean_rails_w"] = {n: j / max(t_end, 1e-9) for n, j in zip(run.rail_names, js)}   # where the power went
    if rail is not None:
        i = run.rail_names.index(rail)
        log = [(t, js[i]) for t, js in run.rail_log]
        row |= {"budget_rail": rail, "mean_rail_w": log[-1][1] / max(log[-1][0], 1e-9),
                "max_window_avg_rail_w": max_window_average(log, measure_window_s),
                "max_window_avg_rail_control_w": max_window_average(log, window_s)}
    st = run.loop.state if run.loop is not None else None
    if budget is not None:          # only capped rows carry the cap (and the word), the baselines none
        row["power_cap_w"] = budget.watts
        row["power_config"] = next((n for n in notes if n.startswith("power budget")), None)
    if isinstance(st, BudgetState) and st.status is not None:
        row |= {"budget_unmet_plans": st.status.unmet_decisions, "budget_capped_plans": st.status.capped_decisions}
    return row


def save_budget_results(cfg: BenchConfig, watts: float, rows: list[dict[str, Any]], out: Path) -> Path:
    """Write ``power-cap-<W>W-<trace>.json`` into ``out``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"power-cap-{watts:g}W-{cfg.trace}.json"
    path.write_text(json.dumps({"config": cfg.__dict__ | {"power_cap_w": watts}, "results": rows}, indent=1,
                               default=str))
    return path


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each capped row's tok/s and average power over the nvpmodel row's."""
    base = next((r for r in rows if str(r["policy"]).startswith(MODE_PREFIX)), None)
    if base is None:
        return
    for cap in rows:
        if cap.get("power_cap_w") is None:
            continue
        cap["vs_nvpmodel"] = {
            "mode": base["nvpmodel_mode"],
            "tokens_per_s_x": cap["tokens_per_s"] / base["tokens_per_s"],
            "decode_tok_s_per_stream_x": (cap["decode_tok_s_per_stream"] / base["decode_tok_s_per_stream"]
                                          if cap["decode_tok_s_per_stream"] and base["decode_tok_s_per_stream"]
                                          else None),
            "mean_power_w_delta": cap["mean_power_w"] - base["mean_power_w"],
        }
