"""`orin-agent quantize`: write a weight-only INT8 / INT4 copy of a checkpoint in the GPTQ layout
(partition/quantize.py), which `generate --model DIR` and the torch runner load back."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from agent.cli.common import cli_errors, print_json
from partition.paths import DEFAULT_MODEL_DIR


def quantize(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help="Checkpoint folder, .gguf file or model alias "
                               "to quantise (a GGUF's blocks are dequantised first); default: the shipped model."),
    bits: int = typer.Option(..., "--bits", help="4 or 8."),
    group: Optional[int] = typer.Option(None, "--group", help="Group size along the input dimension "
                                        "(-1 = per output channel). Default: 128 for 4 bits, -1 for 8 bits."),
    out: Path = typer.Option(..., "--out", help="Folder to write (config.json with quantization_config, "
                             "model.safetensors, tokenizer files)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Quantise MODEL's decoder projections (round-to-nearest) and write a GPTQ-layout checkpoint."""
    from partition.quantize import default_spec, quantize_checkpoint

    from partition.gguf.folder import resolve_model

    with cli_errors():
        summary = quantize_checkpoint(resolve_model(model), out, default_spec(bits, group))
    if as_json:
        print_json(asdict(summary))
        return
    group_text = "per channel" if summary.group_size == -1 else f"group {summary.group_size}"
    typer.echo(f"wrote {summary.out_dir}: INT{summary.bits} {group_text}, {summary.layers_quantised} layers, "
               f"{summary.source_bytes / 1e6:.1f} MB -> {summary.quantised_bytes / 1e6:.1f} MB "
               f"in {summary.seconds:.1f} s")


def register(app: typer.Typer) -> None:
    app.command()(quantize)
