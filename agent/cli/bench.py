"""`orin-agent bench ...`: benchmarks. ``bench power`` replays a request trace through the power
controller against the twin in virtual time, through the service's own scheduler (agent.benchpower over
power.bench), and prints one row per policy. Thin: this file parses options and prints."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agent.cli.common import cli_errors, profile_dir_option

app = typer.Typer(help="Benchmarks: energy per token of the power policies on the twin.", no_args_is_help=True)


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
          plot: bool = typer.Option(True, "--plot/--no-plot", help="Write the PNG plot.")) -> None:
    """Energy per token, TTFT/TPOT, peak power and temperature per policy, side by side."""
    from agent.benchpower import run_power_bench
    from power.bench import BenchConfig, compare, default_out_dir, save_results

    with cli_errors():
        cfg = BenchConfig(board, l4t, shape, precision, trace, ambient, duration, seed, max_batch, fan,
                          tuple(policy), str(profile_dir))
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


def register(root_app: typer.Typer) -> None:
    root_app.add_typer(app, name="bench")
