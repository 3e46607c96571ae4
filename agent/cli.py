"""The `orin-agent` command: a thin typer front over the packages' APIs.

Each command group lives in its own module (``cli_model``: generate/build, ``cli_power``: power,
``cli_twin``: twin); this file only wires them together.
"""
from __future__ import annotations

import typer

from agent import cli_bench, cli_build, cli_model, cli_power, cli_quant, cli_serve, cli_twin

app = typer.Typer(
    name="orin-agent",
    help="Run a large language model on an NVIDIA Jetson Orin: sliced engines, phase-aware power "
    "control and a simulated Orin (the twin) wherever there is no board.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cli_model.register(app)
cli_build.register(app)
cli_serve.register(app)
app.add_typer(cli_power.app, name="power")
app.add_typer(cli_twin.app, name="twin")
cli_bench.register(app)
cli_quant.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
