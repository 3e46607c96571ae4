"""`orin-agent bench ...`: benchmarks. ``bench power`` replays a request trace through the power
controller against the twin in virtual time, through the service's own scheduler (agent.benchmark.power_replay over
power.bench.energy), and prints one row per policy; ``bench run`` is the end-to-end benchmark of the running
configuration in real time (agent.benchmark), writing report.json, PNG plots and summary.md. Thin: the
logic is in those packages; this file parses options and prints."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from agent.cli.common import cli_errors, print_json, profile_dir_option

if TYPE_CHECKING:
    from power.bench.energy import BenchConfig

app = typer.Typer(help="Benchmarks: `run` (end to end, real time, on the board or a twin) and `power` "
                  "(energy per token of the power policies on the twin, virtual time).", no_args_is_help=True)


@app.command("run")
def run(root: Optional[Path] = typer.Option(None, "--root", help="The board's root (/) or a twin folder "
                                            "(default: a fresh twin, removed afterwards)."),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Restore journal (default: the "
                                               "service's: /run/orin-agent on a board, ROOT/run/orin-agent on a twin)."),
        trace: str = typer.Option("chat", "--trace", help="chat, batch or sparse."),
        profile: list[str] = typer.Option([], "--profile", help="Power profile to run (repeatable; "
                                          "default: eco, balanced and max)."),
        config: Optional[Path] = typer.Option(None, "--config", help="Service config (model, backend, "
                                              "device); default /etc/orin-agent/agent.toml if present."),
        profile_dir: Path = profile_dir_option(),
        out: Optional[Path] = typer.Option(None, "--out", help="Folder for report.json, the PNGs and "
                                           "summary.md (default: ~/.cache/orin-agent/bench/TRACE-TIME)."),
        plot: bool = typer.Option(True, "--plot/--no-plot", help="Write the PNG plots."),
        json_out: bool = typer.Option(False, "--json", help="Print report.json's summary on stdout.")) -> None:
    """End to end: tok/s, TTFT, TPOT, J/token per phase and the clocks in force, per profile."""
    from agent.benchmark import run_end_to_end
    from agent.config import load_config

    with cli_errors():
        cfg = load_config(config).with_model_folder()  # [model] dir may name a .gguf file or an alias
        dest, doc = run_end_to_end(root, run_dir, cfg, trace, tuple(profile) or ("eco", "balanced", "max"), out,
                                   str(profile_dir), plot)
    rows = [{k: v for k, v in p.items() if k != "timeline"} for p in doc["profiles"]]  # type: ignore[union-attr]
    if json_out:
        print_json({k: v for k, v in doc.items() if k != "profiles"} | {"profiles": rows, "out": str(dest)})
        return
    if doc["simulated"]:
        typer.echo(str(doc["note"]))
    table = Table(title=f"{trace} trace on {doc['board']} ({doc['model']}, {doc['backend']})")
    for col in ("profile", "tok/s", "TTFT p50 s", "TPOT p50 ms", "J/token", "GPU max MHz pre/dec", "EMC MHz pre/dec"):
        table.add_column(col, justify="left" if col == "profile" else "right")

    def f(v: object, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for p in rows:
        c = p["clocks_in_force_mhz"]
        table.add_row(str(p["profile"]), f(p["throughput_tok_s"], ".1f"), f(p["ttft_p50_s"], ".3f"),
                      f(p["tpot_p50_ms"], ".1f"), f(p["joules_per_token"], ".3f"),
                      f"{f(c['prefill']['gpu_max_mhz'], '.0f')}/{f(c['decode']['gpu_max_mhz'], '.0f')}",
                      f"{f(c['prefill']['emc_mhz'], '.0f')}/{f(c['decode']['emc_mhz'], '.0f')}")
    Console().print(table)
    typer.echo(f"wrote {dest}/summary.md, report.json and {len(doc['plots'])} plot(s)")  # type: ignore[arg-type]


@app.command("power")
def power(board: str = typer.Option("agx-orin-64gb", "--board", help="Twin board."),
          l4t: str = typer.Option("r36", "--l4t", help="L4T layout of the twin (r35 or r36)."),
          shape: str = typer.Option("llama-3-8b", "--model-shape", help="Model shape for the cost model."),
          precision: str = typer.Option("int4", "--precision", help="fp16, int8, int4 or q4f16."),
          trace: str = typer.Option("chat", "--trace", help="chat, rag, batch or sparse."),
          ambient: float = typer.Option(25.0, "--ambient", help="Ambient temperature, °C."),
          duration: float = typer.Option(3600.0, "--duration", min=1.0, help="Trace length, virtual seconds."),
          seed: int = typer.Option(0, "--seed", help="Trace seed."),
          max_batch: int = typer.Option(8, "--max-batch", min=1, help="Sequences decoded together."),
          fan: str = typer.Option("daemon", "--fan", help="daemon (nvfancontrol), ours (controller) or off."),
          policy: list[str] = typer.Option([], "--policy", help="Only these policies (repeatable)."),
          profile_dir: Path = profile_dir_option(),
          json_out: bool = typer.Option(False, "--json", help="One JSON record per policy, one per line."),
          out: Path | None = typer.Option(None, "--out", help="Folder for the results JSON and the plot "
                                          "(default: ~/.cache/orin-agent/bench-power)."),
          plot: bool = typer.Option(True, "--plot/--no-plot", help="Write the PNG plot."),
          power_cap: Optional[float] = typer.Option(None, "--power-cap", min=0.1, help="Watts: the budgeted "
                                                    "controller beside the nvpmodel mode of that wattage."),
          budget_window: float = typer.Option(10.0, "--budget-window", min=1.0, help="The budget's sliding "
                                              "window, s (with --power-cap)."),
          exit_rates: Optional[str] = typer.Option(None, "--exit-rates", help="Credit early exits in decode: "
                                                   "measured rates as LAYER/LAYERS:RATE, e.g. 2/8:0.034,4/8:0.027,"
                                                   "6/8:0.035 (exits.json's held_out exit_rate_per_layer)."),
          exit_gate: bool = typer.Option(False, "--exit-gate", help="With --exit-rates: price an ideal gate "
                                         "(exit heads computed only where a token leaves)."),
          budget_rail: Optional[str] = typer.Option(None, "--budget-rail", help="Budget this INA3221 rail "
                                                    "(e.g. VDD_GPU_SOC) instead of module power (with --power-cap)."),
          boards: int = typer.Option(0, "--boards", min=0, help="Also run every policy on N boards drawn from "
                                     "the cited ranges of the twin's constants; report median and worst over them."),
          board_seed: int = typer.Option(0, "--board-seed", help="Seed of the sampled boards (with --boards).")
          ) -> None:
    """Energy per token, TTFT/TPOT, peak power and temperature per policy, side by side."""
    from agent.benchmark.power_replay import run_power_bench
    from power.bench.energy import BenchConfig, compare, default_out_dir, save_results

    with cli_errors():
        cfg = BenchConfig(board, l4t, shape, precision, trace, ambient, duration, seed, max_batch, fan,
                          tuple(policy), str(profile_dir), exit_rates, exit_gate, boards, board_seed)
        if power_cap is not None:
            _capped(cfg, power_cap, budget_window, out or default_out_dir(), json_out, budget_rail)
            return
        if boards:
            _boards(cfg, out or default_out_dir(), json_out, plot)
            return
        results = run_power_bench(cfg)
        doc = save_results(cfg, results, out or default_out_dir(), plot=plot)
        written = " and ".join(str(p) for p in doc["written"])
        if json_out:
            for r in doc["results"]:
                sys.stdout.write(json.dumps(r, default=str) + "\n")
            typer.echo(f"wrote {written}", err=True)
            return
        deltas = compare(results)
        table = Table(title=f"{trace} trace, {duration:g} s, ambient {ambient:g} °C (twin: {board}, {shape} {precision})")
        for col in ("policy", "J/token", "vs MAXN", "busy J/tok", "idle W", "TTFT p50/p95 s", "TPOT p50/p95 ms",
                    "peak W", "max °C", "s >= trip", "switch µs p50/p95"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in results:
            d = deltas.get(r.policy, {})
            table.add_row(r.policy, f"{r.joules_per_token:.3f}", f"{d['energy_per_token_pct']:+.1f} %" if d else "-",
                          f"{r.busy_joules_per_token:.3f}", f"{r.idle_w:.2f}",
                          f"{r.ttft_p50_s:.3f} / {r.ttft_p95_s:.3f}",
                          f"{r.tpot_p50_s * 1e3:.1f} / {r.tpot_p95_s * 1e3:.1f}", f"{r.peak_power_w:.1f}",
                          f"{r.max_zone_c:.1f}", f"{r.time_above_trip_s:.0f}",
                          "-" if r.switch_cost_us is None else f"{r.switch_cost_us:.0f} / {r.switch_cost_p95_us:.0f}")
        Console().print(table)
        typer.echo(f"wrote {written}")


def _boards(cfg: BenchConfig, out: Path, json_out: bool, plot: bool) -> None:
    from agent.benchmark.power_replay import run_power_boards
    from power.bench.energy import save_board_results

    doc = save_board_results(cfg, run_power_boards(cfg), out, plot=plot)
    written = " and ".join(str(p) for p in doc.pop("written"))
    if json_out:
        sys.stdout.write(json.dumps(doc, default=str) + "\n")
        typer.echo(f"wrote {written}", err=True)
        return

    def cell(x: dict[str, float] | None, sign: float) -> str:
        return "-" if x is None else f"{sign * 100 * x['median']:+.1f} / {sign * 100 * x['worst']:+.1f} %"

    def exact(x: dict[str, float], k: str, sign: float) -> str:
        return f"{sign * 100 * x[k]:+.1f} %" if k in x else "-"
    table = Table(title=f"{cfg.trace} trace, {cfg.duration_s:g} s, {cfg.boards} boards drawn from the constants' "
                  f"ranges (seed {cfg.board_seed}; twin: {cfg.board}, {cfg.shape} {cfg.precision}): median / worst; "
                  f"J/token change (negative: a saving), p95 change vs MAXN + jetson_clocks")
    for col in ("policy", "J vs stock MAXN", "J vs MAXN+jc", "TTFT p95", "TPOT p95", "exact model: vs stock / vs jc / "
                "TTFT / TPOT"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in doc["summary"]:
        e = r["exact_model"]
        table.add_row(str(r["policy"]), cell(r["saving_vs_stock_maxn"], -1), cell(r["saving_vs_maxn_jc"], -1),
                      cell(r["ttft_p95_change"], 1), cell(r["tpot_p95_change"], 1),
                      " / ".join(exact(e, k, s) for k, s in (("saving_vs_stock_maxn", -1), ("saving_vs_maxn_jc", -1),
                                                              ("ttft_p95_change", 1), ("tpot_p95_change", 1))))
    Console().print(table)
    typer.echo(f"wrote {written}")


def _capped(cfg: BenchConfig, watts: float, window_s: float, out: Path, json_out: bool,
            rail: str | None = None) -> None:
    from agent.benchmark.power_replay import run_power_budget_bench
    from power.bench.budget import save_budget_results

    rows = run_power_budget_bench(cfg, watts, window_s, rail)
    path = save_budget_results(cfg, watts, rows, out)
    if json_out:
        for r in rows:
            sys.stdout.write(json.dumps(r, default=str) + "\n")
        typer.echo(f"wrote {path}", err=True)
        return
    table = Table(title=f"{cfg.trace} trace, {cfg.duration_s:g} s, power cap {watts:g} W (twin: {cfg.board}, "
                  f"{cfg.shape} {cfg.precision}); window averages over {rows[0]['measure_window_s']:g} s "
                  f"and {window_s:g} s")
    for col in ("policy", "mode / cores", "tok/s", "x mode", "decode tok/s/stream", "TTFT p95 s", "TPOT p95 ms",
                "mean W", "max window W", f"max {window_s:g}s W", "peak W"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        x = r.get("vs_nvpmodel", {}).get("tokens_per_s_x")
        table.add_row(str(r["policy"]), f"{r['nvpmodel_mode']} / {r['cores_online']}", f"{r['tokens_per_s']:.2f}", "-" if x is None else f"{x:.2f}x",
                      f"{r['decode_tok_s_per_stream'] or 0:.1f}", f"{r['ttft_p95_s']:.2f}",
                      f"{r['tpot_p95_s'] * 1e3:.0f}", f"{r['mean_power_w']:.2f}", f"{r['max_window_avg_w']:.2f}",
                      f"{r['max_window_avg_control_w']:.2f}", f"{r['peak_power_w']:.1f}")
    Console().print(table)
    typer.echo(f"wrote {path}")


def register(root_app: typer.Typer) -> None:
    root_app.add_typer(app, name="bench")
