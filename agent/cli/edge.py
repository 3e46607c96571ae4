"""`orin-agent edge` (the deep layers on Triton Inference Server) and `orin-agent plan` (where to split
between device and edge). Thin: each calls partition.offload."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import typer

from agent.cli.common import cli_errors, print_json
from agent.cli.options import MODEL_HELP
from partition.paths import DEFAULT_MODEL_DIR


def _first_layer(layers: str, n_layers: int) -> int:
    try:
        a, _, b = layers.partition(":")
        first, last = int(a), int(b) if b.strip() else n_layers
    except ValueError:
        raise ValueError(f"--layers {layers!r} is not of the form A:L (e.g. 4:{n_layers})") from None
    if last != n_layers or not 1 <= first < n_layers:
        raise ValueError(f"--layers must be A:{n_layers} with 1 <= A < {n_layers} (the edge runs the deep layers "
                         f"to the end); got {layers!r}")
    return first


def edge(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help=MODEL_HELP),
    layers: str = typer.Option("1:", "--layers", help="A:L — serve layers A..L-1; a device may split at any "
                               "N >= A (default 1: every split)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address Triton listens on (0.0.0.0: all)."),
    port: int = typer.Option(8001, "--port", "--grpc-port", help="gRPC port (KServe v2)."),
    http_port: int = typer.Option(0, "--http-port", help="HTTP port (0: a free one)."),
    metrics_port: int = typer.Option(0, "--metrics-port", help="Prometheus /metrics port (0: a free one)."),
    cap: int = typer.Option(8, "--cap", help="Most live sequences (KV-cache rows)."),
    idle_timeout: float = typer.Option(60.0, "--idle-timeout", help="Seconds without a request before a "
                                       "sequence's state is freed."),
    max_seq: int = typer.Option(1024, "--max-seq", help="Context per sequence in tokens."),
    token: str = typer.Option("", "--token", envvar="ORIN_AGENT_EDGE_TOKEN", help="Require this bearer token "
                              "on inference calls (env ORIN_AGENT_EDGE_TOKEN)."),
    tls_cert: str = typer.Option("", "--tls-cert", help="PEM server certificate (gRPC over TLS)."),
    tls_key: str = typer.Option("", "--tls-key", help="PEM server key."),
    tls_ca: str = typer.Option("", "--tls-ca", help="PEM CA of client certificates: with it, mutual TLS "
                               "(clients must present a certificate it signed)."),
    python: Optional[Path] = typer.Option(None, "--python", envvar="ORIN_AGENT_EDGE_PYTHON",
                                          help="Interpreter for the server (default: the venv "
                                          "scripts/edge-venv.sh builds)."),
    log: Optional[Path] = typer.Option(None, "--log", help="Server log (default: a file in the temp folder)."),
    as_json: bool = typer.Option(False, "--json", help="Print the endpoints as JSON once ready."),
) -> None:
    """Serve the deep layers on Triton Inference Server until interrupted."""
    from partition.config import load_config
    from partition.gguf.folder import resolve_model
    from partition.offload.launch import EdgeOptions, EdgeServer, serve_forever

    with cli_errors():
        model = resolve_model(model)  # a .gguf file or an alias: its model folder
        first = _first_layer(layers, load_config(model).n_layers)
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if tls_ca and not tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs the server's own --tls-cert and --tls-key")
        for f in (tls_cert, tls_key, tls_ca):
            if f and not Path(f).is_file():
                raise ValueError(f"{f}: no such PEM file")
        opts = EdgeOptions(model, first, host, port, http_port, metrics_port, cap, max_seq, idle_timeout,
                           token, str(Path(tls_cert).resolve()) if tls_cert else "",
                           str(Path(tls_key).resolve()) if tls_key else "",
                           str(Path(tls_ca).resolve()) if tls_ca else "", python)
        log_path = log or Path(tempfile.gettempdir()) / "orin-agent-edge" / f"edge-{os.getpid()}.log"

        def ready(s: EdgeServer) -> None:
            info = {"grpc": s.url, "tls": bool(tls_cert), "http_port": s.http_port, "metrics": f"http://{host}:{s.metrics_port}/metrics",
                    "layers": f"{first}:", "log": str(log_path)}
            if as_json:
                print_json(info)
            else:
                typer.echo(f"edge ready: gRPC {info['grpc']}, metrics {info['metrics']}, layers {first}: "
                           f"(log {log_path})", err=True)

        raise typer.Exit(serve_forever(opts, log_path, ready))


def plan(
    model_shape: str = typer.Option("llama-3-8b", "--model-shape", help="A shape name (partition.config "
                                    "presets, e.g. llama-3-8b, llama-3.2-1b)."),
    board: str = typer.Option("orin-nano-8gb", "--board", help="The device board."),
    edge_board: str = typer.Option("agx-orin-64gb", "--edge-board", help="The edge's board (cost model)."),
    rtt_ms: float = typer.Option(20.0, "--rtt-ms", help="Link round-trip time."),
    mbps: float = typer.Option(50.0, "--mbps", help="Link bandwidth, Mbit/s."),
    precision: str = typer.Option("int4", "--precision", help="fp16, int8, int4 or q4f16."),
    context: int = typer.Option(512, "--context", help="Tokens in context."),
    exit_rate: float = typer.Option(0.0, "--exit-rate", help="Fraction of tokens that exit early on the device."),
    power_budget_w: Optional[float] = typer.Option(None, "--power-budget-w", help="Device power cap."),
    objective: str = typer.Option("tok-s", "--objective", help="tok-s or energy (J/token on the device)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Choose how many layers run on the device, and say why."""
    from partition.offload.planner import LinkEstimate, format_plan
    from partition.offload.planner import plan as make_plan
    from power.runtime.shapes import model_shape as shape_named

    with cli_errors():
        shape = shape_named(model_shape)    # an unknown name is a ValueError naming the known ones
        p = make_plan(shape, board, LinkEstimate(rtt_ms, mbps), edge_board, precision, context, exit_rate,
                      power_budget_w, objective)
        if as_json:
            print_json(p.to_dict())
        else:
            typer.echo(format_plan(p))


def register(app: typer.Typer) -> None:
    app.command()(edge)
    app.command()(plan)
