"""`orin-agent serve` (the service, foreground, for systemd) and `orin-agent demo` (the service on a
fresh twin with a few streamed requests)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from agent.cli.common import cli_errors, print_json
from agent.cli.options import MODEL_HELP, BoardOptions, EdgeOptions, ExitOptions, ModelOptions, options, shared_options
from agent.config import ServiceConfig
from partition.paths import DEFAULT_MODEL_DIR


@shared_options
def serve(
    board_opts: BoardOptions = options(BoardOptions, notes={
        "root": "Default: / on an Orin, else a fresh twin in a temp dir.",
        "run_dir": f"Default: {ServiceConfig.run_dir}."}),
    host: Optional[str] = typer.Option(None, "--host", help=f"Listen address (default {ServiceConfig.host})."),
    port: Optional[int] = typer.Option(None, "--port", help=f"Listen port (default {ServiceConfig.port}; 0 = any free port)."),
    token: Optional[str] = typer.Option(None, "--token", help="Bearer token required on every endpoint but "
                                        "/health (prefer server.token_file in the config)."),
    model_opts: ModelOptions = options(ModelOptions, notes={
        "kv_cache": "Default: the config's model.kv_cache, else fp16.",
        "kv_blocks": "Default: the config's model.kv_blocks, else per-row caches."}),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Sequences decoded together (cache rows)."),
    exits: Optional[bool] = typer.Option(None, "--exits/--no-exits", help="Load the exit heads beside the model "
                                         "so requests may ask for early exits or speculation (orin_agent field)."),
    exit_opts: ExitOptions = options(ExitOptions, notes={
        "speculate": "Every request's default; implies --exits.",
        "max_disagreement": "Every request's default; implies --exits."}),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug, info, warning or error."),
    power_cap: Optional[float] = typer.Option(None, "--power-cap", help="Power budget, W: the sliding-window "
                                              "average board power the controller holds (over the watts of "
                                              "the profile's budget section)."),
    edge_opts: EdgeOptions = options(EdgeOptions),
    edge_fallback: Optional[bool] = typer.Option(None, "--edge-fallback/--no-edge-fallback", help="Hold the deep "
                                                 "layers here too, so a failed edge degrades to local decoding "
                                                 "(default on); off: such requests fail with the reason."),
) -> None:
    """Serve the OpenAI-compatible API until SIGTERM; then drain, restore the board and exit 0."""
    from agent.config import load_config
    from agent.service import Service, setup_logging

    with cli_errors():
        b, m = board_opts, model_opts
        cfg = load_config(b.config).replace(root=b.root, run_dir=b.run_dir, host=host, port=port, token=token,
                                            backend=m.backend, model_dir=m.model, max_batch=max_batch,
                                            kv_cache=m.kv_cache, kv_blocks=m.kv_blocks, dtype=m.dtype,
                                            log_level=log_level,
                                            exits=exits, power_cap_w=power_cap, edge_fallback=edge_fallback,
                                            **dataclasses.asdict(exit_opts), **dataclasses.asdict(edge_opts))
        setup_logging(cfg.log_level)
        code = Service(cfg).run()
    raise typer.Exit(code)


def demo(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help=MODEL_HELP),
    max_tokens: int = typer.Option(48, "--max-tokens", "-n", help="Tokens per request."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
) -> None:
    """Run the service on a fresh twin of an AGX Orin, stream a few requests through it, show a table."""
    from rich.console import Console
    from rich.table import Table

    from agent.demo import run_demo
    from agent.service import setup_logging

    console = Console(stderr=as_json, width=None if sys.stdout.isatty() else 130)
    with cli_errors():
        from partition.gguf.folder import resolve_model

        model = resolve_model(model)  # a .gguf file or an alias: its model folder
        if not (model / "config.json").is_file():
            raise ValueError(f"{model}: no model there (config.json missing); the shipped model is made by "
                             "scripts/train_small_model.py, or pass --model DIR")
        setup_logging("warning", sys.stderr if as_json else None)  # stdout is the JSON

        def on_text(piece: str) -> None:
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()

        results = run_demo(model, max_tokens, on_text, lambda m: console.print(m, markup=False))
    if as_json:
        print_json([r.__dict__ for r in results])
        return
    table = Table(title="orin-agent demo (twin of an AGX Orin 64GB; clocks GPU/EMC MHz: what the controller "
                        "applied, and what the board reported, prefill | decode)")
    for col in ("#", "kind", "prompt tok", "out tok", "TTFT ms", "tok/s", "joules", "J/tok",
                "prefill clocks", "decode clocks", "board reported"):
        table.add_column(col, justify="right")
    for i, r in enumerate(results, 1):
        u = r.usage
        j = u.get("energy_joules")
        out = u.get("completion_tokens") or 0
        table.add_row(str(i), r.kind, str(u.get("prompt_tokens", "-")), str(out),
                      f"{r.ttft_s * 1e3:.0f}" if r.ttft_s is not None else "-",
                      f"{r.tok_s:.1f}" if r.tok_s else "-", f"{j:.3f}" if j is not None else "-",
                      f"{j / out:.4f}" if j is not None and out else "-", r.prefill_clocks, r.decode_clocks,
                      f"{r.prefill_board} | {r.decode_board}")
    console.print()
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(demo)
