"""`orin-agent train-exits` and `orin-agent calibrate`: exit heads for a model (partition.exits),
trained on the frozen model and calibrated to a disagreement target; both save beside the model."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from agent.cli.common import cli_errors, print_json
from agent.cli.options import MODEL_HELP
from partition.gguf.folder import resolve_model
from partition.paths import DEFAULT_MODEL_DIR

TEXT_HELP = ("Text for a model without its own corpus record: its blank-line separated paragraphs are dealt into "
             "train / val / test (default: the model's own seeded generations on a fixed prompt set).")


def train_exits(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help=MODEL_HELP),
    layers: Optional[str] = typer.Option(None, "--layers", help="Exit layers, e.g. 2,4,6 (default: every "
                                         "quarter of the depth)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    steps: int = typer.Option(40, "--steps", help="KL distillation steps after the least-squares start."),
    text: Optional[Path] = typer.Option(None, "--text", help=TEXT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Distil exit heads on the frozen model and save them beside it (exits.safetensors, exits.json)."""
    from partition.config import load_config
    from partition.exits.train import TrainOptions, default_layers, train_exits as run

    with cli_errors():
        model = resolve_model(model)  # a .gguf file or an alias: its model folder (the heads are saved there)
        try:
            chosen = tuple(int(v) for v in layers.split(",")) if layers else \
                default_layers(load_config(model).n_layers)
        except ValueError:
            raise ValueError(f"--layers takes comma-separated layer numbers, got {layers!r}") from None
        ensure_corpus(model, text)
        res = run(model, TrainOptions(layers=chosen, steps=steps, device=device), progress=not as_json)
        out = {"heads": str(res.heads_path), "record": str(res.record_path), "seconds": round(res.seconds, 1),
               "held_out_top1_agreement": res.agreement, "logit_lens_agreement": res.lens_agreement}
        if as_json:
            print_json(out)
        else:
            for l in res.agreement:
                typer.echo(f"layer {l}: held-out top-1 agreement {res.agreement[l]:.3f} "
                           f"(logit lens {res.lens_agreement[l]:.3f})")
            typer.echo(f"saved {res.heads_path} and {res.record_path} in {res.seconds:.0f} s")


def calibrate(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, "--model", help=MODEL_HELP),
    max_disagreement: list[float] = typer.Option([0.01], "--max-disagreement", help="Target rate of tokens "
                                                 "that differ from the full model's (repeatable: one data "
                                                 "collection serves every target)."),
    confidence: float = typer.Option(0.95, "--confidence", help="Probability that the target holds."),
    prompts: int = typer.Option(256, "--prompts", help="Prompts per set (calibration and held-out)."),
    text: Optional[Path] = typer.Option(None, "--text", help=TEXT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Certify per-layer exit thresholds for a disagreement target (Learn-then-Test) and save them."""
    from partition.exits.calibrate import CalibrateOptions, calibrate as run

    with cli_errors():
        model = resolve_model(model)
        ensure_corpus(model, text)
        first, *rest = max_disagreement
        entries = run(model, CalibrateOptions(first, confidence, prompts), progress=not as_json,
                      more_targets=tuple(rest))
        if as_json:
            print_json(entries)
            return
        for entry in entries:
            held = entry["held_out"]
            assert isinstance(held, dict)
            typer.echo(f"target {entry['target']} at confidence {confidence}: thresholds {entry['thresholds']}; "
                       f"held-out disagreement {held['disagreement']}, exits {held['exit_rate_per_layer']}, "
                       f"{held['mean_layers_per_token']} layers per token")


def ensure_corpus(model: Path, text: Path | None) -> None:
    """A model without a corpus record of its own gets one beside it: TEXT's paragraphs, else the model's own
    seeded generations (an instruct model answering through its chat template); partition/exits/corpus.py."""
    from agent.chat import chat_text
    from partition.exits.corpus import GENERATED_RECORD, TEXT_RECORD, generated_corpus, text_file_corpus
    from partition.tokenizer import Tokenizer

    own = (model / "corpus.json").is_file()
    if text is not None:
        if own:
            raise ValueError(f"{model} has its own corpus record (corpus.json): drop --text")
        if not text.is_file():
            raise ValueError(f"--text {text}: no such file")
        text_file_corpus(model, text)
    elif not own and not (model / TEXT_RECORD).is_file() and not (model / GENERATED_RECORD).is_file():
        tok = Tokenizer.from_dir(model)
        generated_corpus(model, (lambda p: chat_text(tok, p)) if tok.chat_template else None)


def register(app: typer.Typer) -> None:
    app.command("train-exits")(train_exits)
    app.command("calibrate")(calibrate)
