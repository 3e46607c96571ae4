"""`orin-agent twin ...`: create and run the simulated Orin.

A thin client over ``power.twin``: ``create`` lays out a board's tree, ``run`` runs the board model on
it in real time, with the workload the engine writes to ``<DIR>/run/orin-agent-twin/workload.json``.
Errors are one clear line and exit code 2 (the shared ``cli_errors``), never a traceback.
"""
from __future__ import annotations

from pathlib import Path

import typer

from agent.cli.common import cli_errors, print_json
from power.hw.rootlock import BoardLock
from power.physics.boards import BOARDS, L4T_RELEASES
from power.twin import WORKLOAD_FILE, Twin, TwinState, create_twin

app = typer.Typer(help="The simulated Orin: lay out a board's sysfs tree in a folder and run its model.",
                  no_args_is_help=True)


@app.command()
def create(
    directory: Path = typer.Argument(..., help="Folder to lay the board's tree out in."),
    board: str = typer.Option("agx-orin-64gb", "--board", help=f"One of: {', '.join(BOARDS)}."),
    l4t: str = typer.Option("r36", "--l4t", help=f"L4T layout: {' or '.join(L4T_RELEASES)}."),
    ambient: float = typer.Option(25.0, "--ambient", help="Starting temperature, °C."),
    no_debugfs: bool = typer.Option(False, "--no-debugfs", help="Leave /sys/kernel/debug out (as in a container)."),
    nvpmodel_conf: str = typer.Option("file", "--nvpmodel-conf",
                                      help="/etc/nvpmodel.conf as a file, absent, or a symlink into /etc/nvpmodel/."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Lay out BOARD's sysfs / procfs / etc tree (L4T r35 or r36 layout) in DIRECTORY."""
    with cli_errors():
        if board not in BOARDS:
            raise ValueError(f"unknown board {board!r}; valid boards: {', '.join(BOARDS)}")
        if l4t not in L4T_RELEASES:
            raise ValueError(f"unknown L4T release {l4t!r}; valid: {', '.join(L4T_RELEASES)}")
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{directory} exists and is not a folder")
        try:
            paths = create_twin(directory, board, l4t, ambient_c=ambient, debugfs=not no_debugfs,
                                nvpmodel_conf=nvpmodel_conf)
        except OSError as e:
            raise OSError(f"cannot create the twin in {directory}: {e}") from e
    result = {"root": str(directory), "board": board, "l4t": l4t,
              "gpu_devfreq": paths.gpu_devfreq, "workload_file": WORKLOAD_FILE}
    if json_out:
        print_json(result)
    else:
        typer.echo(f"twin {board} ({l4t}) laid out in {directory}")
        typer.echo(f"  run it:      orin-agent twin run {directory}")
        typer.echo(f"  workload:    {directory / WORKLOAD_FILE}")


def _line(st: TwinState) -> str:
    c = st.clocks
    return (f"t={st.t_s:7.1f}s gpu={c.gpu_hz / 1e6:7.2f}MHz emc={c.emc_hz / 1e6:6.0f}MHz "
            f"board={st.power.board_w:5.1f}W max={st.max_temp_c:5.1f}C fan={st.fan_pwm:3d}"
            + (" THROTTLED" if st.throttle_steps else "") + (" SHUTDOWN" if st.shutdown else ""))


@app.command()
def run(
    directory: Path = typer.Argument(..., help="A folder made by `orin-agent twin create`."),
    ambient: float = typer.Option(25.0, "--ambient", help="Ambient temperature, °C."),
    period: float = typer.Option(0.1, "--period", help="Seconds between model steps."),
    duration: float | None = typer.Option(None, "--duration", help="Stop after this many seconds "
                                          "(default: run until Ctrl-C)."),
    no_fan_daemon: bool = typer.Option(False, "--no-fan-daemon", help="Do not emulate nvfancontrol: "
                                       "the fan's pwm1 is left to the agent."),
    quiet: bool = typer.Option(False, "--quiet", help="No status line."),
) -> None:
    """Run the board model on DIRECTORY in real time until Ctrl-C (or --duration)."""
    with cli_errors():
        if period <= 0:
            raise ValueError("--period must be > 0")
        try:
            twin = Twin(directory, ambient_c=ambient, fan_daemon=not no_fan_daemon, atomic_writes=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"{directory} is not a twin tree (no {directory}/run/orin-agent-twin/twin.json); "
                                    f"make one with `orin-agent twin create {directory}`") from None
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"cannot open the twin in {directory}: {e}") from None
        every = max(1, round(1.0 / period))
        ticks = [0]

        def tick(st: TwinState) -> None:
            ticks[0] += 1
            if not quiet and ticks[0] % every == 0:
                typer.echo(_line(st))

        # The model writes the clocks it settles (and the fan daemon's PWM): the board's one owner,
        # refused beside a service, which runs its own model of the same twin.
        with BoardLock(directory, "orin-agent twin run"):
            try:
                st = twin.run(period_s=period, duration_s=duration, on_tick=tick)
            except KeyboardInterrupt:
                st = twin.state
            except OSError as e:
                raise OSError(f"twin stopped: {e}") from None
    if not quiet:
        typer.echo(f"stopped: {_line(st)} energy={st.energy_j:.1f}J")


@app.command()
def predict(
    board: str = typer.Option("agx-orin-64gb", "--board", help=f"One of: {', '.join(BOARDS)}."),
    l4t: str = typer.Option("r36", "--l4t", help="L4T release (the Orin Nano is 'Super' on r36)."),
    shape: str = typer.Option("llama-3-8b", "--model-shape", help="A model shape preset."),
    precision: str = typer.Option("int4", "--precision", help="fp16, int8, int4 (FP16 LM head: TensorRT-LLM AWQ), "
                                  "q4f16_1 (MLC) or q4_k_m (llama.cpp)."),
    runtime: str = typer.Option("tensorrt-llm", "--runtime", help="Whose efficiencies and per-step overhead: "
                                "tensorrt-llm, mlc or llama.cpp."),
    gpu_mhz: float | None = typer.Option(None, "--gpu-mhz", help="GPU clock (default: the mode's cap)."),
    emc_mhz: float | None = typer.Option(None, "--emc-mhz", help="EMC rate (default: the mode's cap)."),
    nvpmodel: str | None = typer.Option(None, "--nvpmodel", help="Power mode name or id (default: the "
                                        "mode without caps, e.g. MAXN)."),
    phase: str = typer.Option("decode", "--phase", help="decode or prefill."),
    tokens: int = typer.Option(512, "--tokens", help="Decode: context length; prefill: prompt tokens."),
    batch: int = typer.Option(1, "--batch", help="Sequences per decode step."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """The twin's tok/s, step time, rail watts and J/token at one operating point (to hold against a
    measurement; docs/TWIN_VALIDATION.md)."""
    from power.physics.predict import PointQuery, predict_point
    from power.runtime.shapes import model_shape

    with cli_errors():
        p = predict_point(PointQuery(model_shape(shape), board, l4t, precision, phase, tokens, batch, nvpmodel,
                                     gpu_mhz, emc_mhz, runtime))
    if json_out:
        print_json(p.__dict__)
        return
    rails = " ".join(f"{k}={v:.2f}W" for k, v in p.rails_w.items())
    typer.echo(f"{p.board} {p.mode} GPU {p.gpu_mhz:.1f} MHz x{p.tpcs} TPC, EMC {p.emc_mhz:.0f} MHz: {p.shape} "
               f"{p.precision} ({p.runtime}) {p.phase} tokens={p.tokens} batch={p.batch}: {p.step_ms:.1f} ms/step, "
               f"{p.tokens_per_s:.1f} tok/s ({p.bound}-bound), board {p.board_w:.1f} W ({rails}), "
               f"{p.joules_per_token:.3f} J/token")


def register(root_app: typer.Typer) -> None:
    root_app.add_typer(app, name="twin")
