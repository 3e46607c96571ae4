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
                               "*.safetensors), .gguf file (its blocks dequantised: the slices are float graphs) or "
                               "model alias. Default: the shipped small model."),
    exporter: str = typer.Option("torchscript", "--exporter", help="torchscript (legacy, default: what "
                                 "TensorRT 8.5 parses) or dynamo."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Compare each slice with the torch "
                                "slice on ONNX Runtime (fp32, max abs diff <= 1e-3)."),
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="fp16 (unquantised cache I/O) or int8: "
                                 "QuantizeLinear/DequantizeLinear around each slice's K/V I/O with static per-channel "
                                 "scales calibrated on the model's validation text (recorded in the manifest)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON on stdout."),
    check_trt: Optional[str] = typer.Option(None, "--check-trt", help="Check the slices against one TensorRT "
                                            "version's ONNX-parser rules: 8.5, 8.6 or 10.3 (reuses a matching "
                                            "build in --out)."),
    engine: Optional[str] = typer.Option(None, "--engine", help="trt: also build a TensorRT engine per slice "
                                         "(needs TensorRT and the GPU; engines go to the engine cache)."),
    precision: str = typer.Option("fp16", "--precision", help="Engine precision: fp32, fp16, int8-wo, int4-wo "
                                  "(weight-only engines need Q/DQ slices, not in this build) or auto: measure a "
                                  "per-layer weight-only plan on held-out text (CPU, no TensorRT) and write it "
                                  "to --out/precision_plan.json."),
    max_ppl_increase: str = typer.Option("1%", "--max-ppl-increase", help="With --precision auto: the "
                                         "perplexity increase the plan may cost (1% or 0.01)."),
    builder: str = typer.Option("api", "--builder", help="api (TensorRT's Python API) or trtexec."),
    workspace_mb: Optional[int] = typer.Option(None, "--workspace-mb", help="Builder workspace; default: "
                                               "sized from free GPU memory."),
    max_batch: int = typer.Option(1, "--max-batch", help="Rows the engines accept (as serve/generate use)."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", help="KV-cache length the engines accept "
                                          "(default: as load_chain, the model's context capped at 8192)."),
    engine_cache: Optional[Path] = typer.Option(None, "--engine-cache", help="Engine cache folder "
                                                "(default ~/.cache/orin-agent/engines)."),
) -> None:
    """Export the model's slices to ONNX for TensorRT / ONNX Runtime, check and verify each one."""
    # Imported here so that `orin-agent --help` stays fast (torch and onnx are heavy).
    from partition.build import BuildError, build_slices, check_build, ensure_build, resolve_slices
    from partition.build.export import ExportError, ExportOptions
    from partition.build.trt_versions import rules_for

    with cli_errors():
        from partition.gguf.folder import is_gguf_ref, resolve_model

        model = resolve_model(model) if is_gguf_ref(model) else model  # a .gguf file or an alias: its folder
        if not model.is_dir():
            hint = " (the shipped model is not there yet: pass --model DIR)" if model == DEFAULT_MODEL_DIR else ""
            raise FileNotFoundError(f"model folder {model} does not exist{hint}")
        options = ExportOptions(exporter=exporter, kv_cache=kv_cache)
        specs = resolve_slices(model, slices)
        if check_trt:
            rules_for(check_trt)  # an unknown version fails here, before any export
        if engine and engine != "trt":
            raise ValueError(f"--engine {engine!r}: the only engine is trt")
        if engine and kv_cache == "int8":
            raise ValueError("--engine trt with --kv-cache int8 is not built yet (the TensorRT runner binds fp32 "
                             "cache buffers only); drop --engine, or build --kv-cache fp16 engines")
        if precision == "auto":
            from partition.trt.autoquant import parse_budget
            budget = parse_budget(max_ppl_increase)
            if engine:  # engines from a mixed plan need weight-only Q/DQ slices: refused before any work
                from partition.trt.precision import plan_for
                plan_for("auto")
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
                if check_trt or engine:  # reuse the build already in --out when it matches
                    _, manifest = ensure_build(model, specs, build_dir=out, options=options, progress=progress,
                                               verify=verify)
                else:
                    manifest = build_slices(model, specs, out, options, verify=verify, progress=progress)
            except (BuildError, ExportError) as exc:  # a failed export or check: its message says what failed
                raise ValueError(str(exc)) from None
        data = manifest.to_json()
        trt_errors = [f"{f}: {e}" for f, r in check_build(out, manifest, check_trt).items() for e in r.errors] \
            if check_trt else []
        if check_trt:
            data["trt_check"] = {"version": check_trt, "errors": trt_errors}
        if precision == "auto":
            from partition.trt.autoquant import auto_precision, write_plan
            auto = auto_precision(model, budget)
            plan_path = write_plan(auto, out)
            data["precision_plan"] = {"file": plan_path.name, "plan": auto.plan, "budget": auto.budget,
                                      "measured_ppl_increase": auto.measured_increase,
                                      "predicted_ppl_increase": auto.predicted_increase,
                                      "base_perplexity": auto.base_perplexity, "weight_bytes": auto.weight_bytes,
                                      "fp16_bytes": auto.fp16_bytes, "bytes_vs_fp16": auto.bytes_ratio}
        if as_json:
            print_json(data)
        else:
            for s in data["slices"]:
                diff = max(s["max_abs_diff"].values()) if s["max_abs_diff"] else float("nan")
                typer.echo(f"{s['start']:>3}:{s['end']:<3} {out / s['file']}  max|ort-torch| {diff:.2e}  "
                           f"{sum(s['op_counts'].values())} nodes")
            typer.echo(f"manifest: {out / 'manifest.json'} (opset {data['opset']}, {data['exporter']} exporter, "
                       f"{data['kv_cache']} KV-cache)")
            cal = data["kv_calibration"]
            if cal:
                typer.echo(f"INT8 KV scales: {cal['tokens']} tokens of the {cal['data']}, {cal['method']}")
        if trt_errors:
            raise ValueError(f"not TensorRT {check_trt}-compatible ({len(trt_errors)} problems): "
                             + "; ".join(trt_errors))
        if check_trt and not as_json:
            typer.echo(f"TensorRT {check_trt} ONNX-parser rules: every slice passes (a static check; no engine built)")
        if precision == "auto" and not as_json:
            typer.echo(f"precision plan: {plan_path} ({auto.plan_key}); perplexity {auto.base_perplexity:.3f} "
                       f"+{100 * auto.measured_increase:.3f}% measured (+{100 * auto.predicted_increase:.3f}% "
                       f"predicted, budget {100 * auto.budget:.3f}%, {auto.calibration_tokens} held-out tokens); "
                       f"decoder weights {auto.weight_bytes / 2**20:.2f} MiB vs {auto.fp16_bytes / 2**20:.2f} MiB "
                       f"fp16 ({100 * auto.bytes_ratio:.1f}%)")
        if engine:
            from partition.trt.api import TrtUnavailable
            from partition.trt.api_builder import EngineBuildError
            from partition.trt.slice_engines import build_slice_engines

            try:
                built = build_slice_engines(out, manifest, precision, builder, workspace_mb, max_batch, max_seq,
                                            engine_cache, log=lambda m: typer.echo(m, err=True))
            except (TrtUnavailable, EngineBuildError) as exc:  # RuntimeErrors whose message says what to do
                raise ValueError(str(exc)) from None
            for e in built:
                typer.echo(f"{e.slice:>7} {e.engine}  {'cached' if e.cached else f'built in {e.seconds:.1f} s'}")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
