"""The `orin-agent` command: a thin typer front over the packages' APIs. This file only wires the
command groups together; each lives in its own module with ``register(app)``:

- ``generate``: one prompt through the service's own engine (agent.engine), text to stdout;
- ``build``: export a model's slices to ONNX (partition.build); ``quant``: ``quantize``, weight-only
  INT8/INT4 checkpoints (partition.quantize);
- ``serve``: the service (agent.service) and ``demo`` (agent.demo: the service on a twin);
- ``power`` (status, restore) with ``profiles`` (profiles, show, set, state): the board's power;
- ``twin``: create and run a simulated Orin; ``bench``: the benchmarks;
- ``smoke``: whether everything works on this board or twin (agent.smoke);
- ``train-exits`` and ``calibrate``: early-exit heads (partition.exits); ``edge`` and ``plan``: the
  deep layers on an edge server (partition.offload).

``common`` holds what every command shares: the one error wrapper (one line, never a traceback) and
the ``--json`` printer.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

GROUPS = ("generate", "build", "quant", "serve", "power", "twin", "bench", "smoke", "edge", "exits")
# Commands whose module is imported alone when the command line names them: `generate` then loads neither rich nor
# the power stack (their imports were ~18 MB of a 103 MB peak RSS for the shipped model as GGUF, docs/BENCHMARKS.md).
ALONE = {"generate": "generate"}
HELP = ("Run a large language model on an NVIDIA Jetson Orin: sliced engines, phase-aware power control and a "
        "simulated Orin (the twin) wherever there is no board.")


def make_app(groups: tuple[str, ...] = GROUPS) -> typer.Typer:
    """The command with the given groups' commands registered (each module's ``register``)."""
    app = typer.Typer(name="orin-agent", help=HELP, no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)
    if len(groups) == 1:
        app.callback()(lambda: None)  # a group, not a single command: `orin-agent generate PROMPT` still parses
    for name in groups:
        importlib.import_module(f"agent.cli.{name}").register(app)
    return app


def __getattr__(name: str) -> Any:
    """`agent.cli.app`: the whole command, built on first use (tests run it through typer's CliRunner)."""
    if name == "app":
        globals()["app"] = make_app()
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    """Run the command line; a command in ALONE registers only its own module."""
    args = sys.argv[1:] if argv is None else argv
    alone = ALONE.get(args[0]) if args else None  # the command must come first: `--help generate` is the whole app
    app = make_app((alone,)) if alone else make_app()
    app(args=args)


if __name__ == "__main__":
    main()
