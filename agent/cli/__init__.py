"""The `orin-agent` command: a thin typer front over the packages' APIs. This file only wires the
command groups together; each lives in its own module with ``register(app)``:

- ``generate``: one prompt through the service's own engine (agent.engine), text to stdout;
- ``build``: export a model's slices to ONNX (partition.build);
- ``serve``: the service (agent.service) and ``demo`` (agent.demo: the service on a twin);
- ``power`` (status, restore) with ``profiles`` (profiles, show, set, state): the board's power;
- ``twin``: create and run a simulated Orin; ``bench``: the benchmarks;
- ``smoke``: whether everything works on this board or twin (agent.smoke).

``common`` holds what every command shares: the one error wrapper (one line, never a traceback) and
the ``--json`` printer.
"""
from __future__ import annotations

import typer

from agent.cli import bench, build, edge, generate, power, serve, smoke, twin

app = typer.Typer(
    name="orin-agent",
    help="Run a large language model on an NVIDIA Jetson Orin: sliced engines, phase-aware power "
    "control and a simulated Orin (the twin) wherever there is no board.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for group in (generate, build, serve, power, twin, bench, smoke, edge):
    group.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
