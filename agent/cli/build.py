"""`orin-agent build`: export a model's slices to ONNX (checked, compared with torch, with a
manifest), with a progress bar per slice. A thin front over partition.build.build_slices; errors go
through the shared `cli_errors` (one line, exit 2, never a traceback)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from agent.cli.common import cli_errors, print_json
from partition.paths import DEFAULT_MODEL_DIR

_LABELS = {"export": "exporting + checking", "compare": "comparing with torch", "done": "done"}


def build(
    slices: Optional[str] = typer.Option(None, "--slices", help="Layer ranges START:END, comma-separated, "
                                         "contiguous from 0 to the last layer (e.g. 0:4,4:8). Default: one slice."),
    out: Path = typer.Option(..., "--out", help="Folder for the ONNX files and manifest.json."),
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help="Checkpoint folder (config.json, "
                               "*.safetensors). Default: the shipped small model."),
    exporter: str = typer.Option("torchscript", "--exporter", help="torchscript (legacy, default: what "
                                 "TensorRT 8.5 parses) or dynamo."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Compare each slice with the torch "
                                "slice on ONNX Runtime (fp32, max abs diff <= 1e-3)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON on stdout."),
) -> None:
    """Export the model's slices to ONNX for TensorRT / ONNX Runtime, check and verify each one."""
    # Imported here so that `orin-agent --help` stays fast (torch and onnx are heavy).
    from partition.build import BuildError, build_slices, resolve_slices
    from partition.export import ExportError, ExportOptions

    with cli_errors():
        if not model.is_dir():
            hint = " (the shipped model is not there yet: pass --model DIR)" if model == DEFAULT_MODEL_DIR else ""
            raise FileNotFoundError(f"model folder {model} does not exist{hint}")
        options = ExportOptions(exporter=exporter)
        specs = resolve_slices(model, slices)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out {out} exists and is not a folder")
        console = Console(stderr=True)
        with Progress(TextColumn("slice {task.fields[slice]:>7}"), BarColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=console, transient=as_json) as bar:
            # Steps per slice, as partition.build reports them: export (+ checks), [compare], done.
            total = 2 if verify else 1
            tasks = [bar.add_task("waiting", total=total, slice=str(s)) for s in specs]

            def progress(i: int, spec: object, stage: str) -> None:
                step = {"export": 0, "compare": 1, "done": total}[stage]
                bar.update(tasks[i], completed=step, description=_LABELS[stage])

            try:
                manifest = build_slices(model, specs, out, options, verify=verify, progress=progress)
            except (BuildError, ExportError) as exc:  # a failed export or check: its message says what failed
                raise ValueError(str(exc)) from None
    data = manifest.to_json()
    if as_json:
        print_json(data)
        return
    for s in data["slices"]:
        diff = max(s["max_abs_diff"].values()) if s["max_abs_diff"] else float("nan")
        typer.echo(f"{s['start']:>3}:{s['end']:<3} {out / s['file']}  max|ort-torch| {diff:.2e}  "
                   f"{sum(s['op_counts'].values())} nodes")
    typer.echo(f"manifest: {out / 'manifest.json'} (opset {data['opset']}, {data['exporter']} exporter)")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
