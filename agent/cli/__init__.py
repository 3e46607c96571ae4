"""The `orin-agent` command: a thin typer front over the packages' APIs.

One module per command group, each with ``register(app)``: ``generate`` (generate), ``build`` (build),
``serve`` (serve, demo), ``power`` (power status/restore, with ``profiles``: profiles/show/set/state),
``twin`` (twin create/run), ``bench`` (bench power). ``common`` holds the one error wrapper, the
``--json`` printer and the options every board command shares. This file only wires them together.
"""
from __future__ import annotations

import typer

from agent.cli import bench, build, generate, power, serve, twin

app = typer.Typer(
    name="orin-agent",
    help="Run a large language model on an NVIDIA Jetson Orin: sliced engines, phase-aware power "
    "control and a simulated Orin (the twin) wherever there is no board.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for group in (generate, build, serve, power, twin, bench):
    group.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
