"""Which twin constants carry the energy goals: balanced's saving against stock MAXN and MAXN + jetson_clocks
and its p95 TTFT / TPOT change, with one constant of power.bench.truth.RANGES at each end of its cited range
and every other at its nominal value (the planner's own), on the service's scheduler and the chat trace, as
`orin-agent bench power` runs them. With ``--oracle`` balanced also runs with a planner that knows the board's
constants: what a controller that had learned the board perfectly would reach within the profile's latency
targets (so a shortfall the oracle shares is the board's, not the controller's). ``--set name=value,...``
runs one board with those constants moved together; ``--boards N`` runs the oracle comparison on the bench's
sampled boards 1..N instead of the one-at-a-time sweep.

    python3 scripts/bench_energy_sensitivity.py [--oracle] [--json OUT] [--set decode_wait_intensity=0.05,...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterator

from agent.benchmark.power_replay import scheduler_driver
from power.bench.energy import BenchConfig, outcomes, run_bench
from power.bench.truth import RANGES, BoardTruth, board, nominal, sample
from power.physics.boards import board_for
from power.policy import dvfs

POLICIES = ("maxn+jetson_clocks", "stock-maxn", "balanced")


@contextlib.contextmanager
def oracle_planner(truth: BoardTruth) -> Iterator[None]:
    """Every planner made inside plans with ``truth``'s constants (the board's own, not the nominal ones)."""
    orig = dvfs.Planner.__dict__["for_board"]

    def for_board(cls: type, spec: object, shape: object, precision: str, mode_id: int | None = None) -> dvfs.Planner:
        p = orig.__func__(cls, spec, shape, precision, mode_id)
        return dvfs.Planner(truth.spec, p.shape, p.precision, p.tpcs, truth.params)

    dvfs.Planner.for_board = classmethod(for_board)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        dvfs.Planner.for_board = orig  # type: ignore[method-assign]


def measure(cfg: BenchConfig, truth: BoardTruth, oracle: bool) -> dict[str, object]:
    res = run_bench(cfg, scheduler_driver, truth)
    row: dict[str, object] = {"balanced": outcomes(res)["balanced"]}
    if oracle:
        with oracle_planner(truth):
            bal = run_bench(BenchConfig(**{**cfg.__dict__, "policies": ("balanced",)}), scheduler_driver, truth)
        oc = {**{r.policy: r for r in res}, "balanced": bal[0]}
        row["oracle"] = outcomes(list(oc.values()))["balanced"]
    return row


def line(name: str, row: dict[str, object]) -> str:
    def cells(o: dict[str, float]) -> str:
        return (f"{100 * o['saving_vs_stock_maxn']:.1f} % | {100 * o['saving_vs_maxn_jc']:.1f} % | "
                f"{100 * o['ttft_p95_change']:+.1f} % | {100 * o['tpot_p95_change']:+.1f} %")
    out = f"| {name} | {cells(row['balanced'])} |"                     # type: ignore[arg-type]
    if "oracle" in row:
        out += f" {cells(row['oracle'])} |"                            # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle", action="store_true", help="also run balanced with the board's own constants")
    ap.add_argument("--set", default="", help="one board: name=value,... moved together (names: RANGES)")
    ap.add_argument("--boards", type=int, default=0, help="the bench's sampled boards 1..N instead of the sweep")
    ap.add_argument("--only", default="", help="comma-separated RANGES names to sweep (default: all)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    cfg = BenchConfig(policies=POLICIES)
    spec = board_for(cfg.board, cfg.l4t)
    nom = nominal(spec)
    names = {r.name: r for r in RANGES}
    boards: list[tuple[str, BoardTruth]] = []
    if a.set:
        moved = {}
        for item in a.set.split(","):
            k, _, v = item.partition("=")
            if k not in names:
                print(f"--set: unknown constant {k!r}; allowed: {', '.join(names)}", file=sys.stderr)
                return 2
            try:
                moved[k] = float(v)
            except ValueError:
                print(f"--set: {item!r} is not name=number", file=sys.stderr)
                return 2
        boards.append((", ".join(f"{k} {v:g}" for k, v in moved.items()), board(spec, {**nom, **moved})))
    elif a.boards:
        boards += [(t.label, t) for t in sample(spec, a.boards, cfg.board_seed)]
    else:
        only = [n for n in a.only.split(",") if n] or list(names)
        for n in only:
            if n not in names:
                print(f"--only: unknown constant {n!r}; allowed: {', '.join(names)}", file=sys.stderr)
                return 2
        boards.append(("all nominal", board(spec, nom)))
        for n in only:
            r = names[n]
            for v in (r.lo, r.hi):
                boards.append((f"{n} {v:g} (nominal {nom[n]:g})", board(spec, {**nom, n: v})))
    head = "| board | vs stock MAXN | vs MAXN+jc | p95 TTFT | p95 TPOT |"
    if a.oracle:
        head += " oracle vs stock | oracle vs jc | oracle TTFT | oracle TPOT |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = []
    for name, truth in boards:
        t0 = time.perf_counter()
        row = measure(cfg, truth, a.oracle)
        rows.append({"board": name, "values": dict(truth.values), **row, "wall_s": time.perf_counter() - t0})
        print(line(name, row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
