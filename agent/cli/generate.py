"""`orin-agent generate`: one prompt through the sliced model on the service's own engine
(`agent.engine.core.EngineCore`, stepped here without the service's thread), text streamed to stdout,
timings to stderr (or everything in one --json object)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from agent.cli.common import cli_errors, print_json
from agent.cli.options import EdgeOptions, ExitOptions, ModelOptions, options, shared_options
from partition.config import DEFAULT_DTYPE, MAX_SEQ_CAP, default_dtype
from partition.paths import DEFAULT_MODEL_DIR


@shared_options
def generate(
    prompt: str = typer.Argument(..., help="Text to continue (with --chat: the user's message)."),
    model_opts: ModelOptions = options(ModelOptions, model=DEFAULT_MODEL_DIR, backend="auto", kv_cache="fp16",
                                       notes={"backend": "Default auto: the fastest measured runner for the model "
                                              "here (a quantised model on the CPU: ort; else torch)."}),
    slices: Optional[str] = typer.Option(None, help="Layer ranges, e.g. 0:4,4:8 (default: one slice)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="1 = off."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (reproducible output)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Send PROMPT as a user message through the model's chat "
                              "template (what /v1/chat/completions renders) and stop at its end-of-turn token; "
                              "without --chat the prompt is continued as raw text."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", help="KV-cache length in tokens "
                                          f"(default: the model's context, at most {MAX_SEQ_CAP})."),
    device: str = typer.Option("cpu", help="cpu or cuda (torch backend)."),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="Replay decode "
                                               "steps as CUDA graphs (torch backend; default: on with "
                                               "--device cuda, off on CPU, where asking for it is an error)."),
    exit_opts: ExitOptions = options(ExitOptions),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming."),
    edge_opts: EdgeOptions = options(EdgeOptions, device_layers="4", edge_token="", link_dtype="fp16",
                                     edge_tls_ca="", edge_tls_cert="", edge_tls_key=""),
    board: str = typer.Option("orin-nano-8gb", "--board", help="With --device-layers auto: this device's "
                              "board in the planner's cost model."),
    activations: str = typer.Option("auto", "--activations", help="A quantised model on the ONNX Runtime decoder "
                                    "(the CPU default): auto (the faster exact one on this CPU, measured once and "
                                    "cached), fp32 or split (both: greedy tokens equal the dequantised model's), "
                                    "mixed (int8 in the gate/up projection only: ~98.7 % of its greedy tokens) or "
                                    "int8 (fastest, about llama.cpp's fidelity, ~96.8 %: docs/BENCHMARKS.md)."),
    spin: Optional[bool] = typer.Option(None, "--spin/--no-spin", help="ONNX Runtime's thread pool spins between "
                                        "ops (default: on for the decoder graph, 1.3-1.4x decode on 2 quiet cores; "
                                        "--no-spin on a CPU shared with other work)."),
) -> None:
    """Generate text from PROMPT, streamed to stdout; timings go to stderr (or all into --json)."""
    from agent.engine.types import Finished, SamplingParams
    from agent.model_load import decoder_precision, decoder_threads, load_core
    from agent.chat import chat_text
    from partition.gguf.folder import resolve_model
    from partition.runners.backend_choice import resolve_backend

    model, backend, kv_cache, kv_blocks = (model_opts.model, model_opts.backend, model_opts.kv_cache,
                                           model_opts.kv_blocks)
    max_disagreement, edge, dtype = exit_opts.max_disagreement, edge_opts.edge, model_opts.dtype
    given = model
    with cli_errors():
        model = resolve_model(model)  # a .gguf file or an alias: its model folder (partition/gguf/folder.py)
        k = resolve_speculate(model, exit_opts.speculate)
        if edge and k:
            raise ValueError("--speculate verifies drafts with the last slice's every-position logits, which "
                             "the edge does not return; use --max-disagreement with --edge, or drop --edge")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop),
                                speculate=k, max_disagreement=max_disagreement)
        exits = bool(k) or max_disagreement is not None
        backend = ("torch" if backend == "auto" and dtype not in (None, DEFAULT_DTYPE) else  # the one runner with
                   resolve_backend(backend, model, device, slices, kv_cache, kv_blocks, exits=exits,  # a dtype choice
                                   edge=bool(edge)))
        dtype = dtype or default_dtype(backend, device, exits)
        chain, split = None, ""
        if edge:
            from partition.offload.auto import offload_chain_for_generate  # only with --edge: 2.5 MB of RSS
            from partition.offload.link import link_options

            e = edge_opts
            opts = link_options(e.edge_token, temperature != 0, e.link_dtype, e.edge_tls_ca, e.edge_tls_cert,
                                e.edge_tls_key)
            chain, split = offload_chain_for_generate(model, edge, e.device_layers, max_disagreement, opts, backend,
                                                      slices, max_seq, device, board)
        core = load_core(model, backend, slices, max_seq, device, cuda_graphs, chain=chain, exits=exits,
                         kv_cache=kv_cache, kv_blocks=kv_blocks, dtype=dtype, activations=activations,
                         spinning=spin)
        text = chat_text(core.tokenizer, prompt) if chat else prompt
        pieces: list[str] = []
        done: Finished | None = None
        for ev in core.generate(core.tokenizer.encode(text), params):
            if isinstance(ev, Finished):
                done = ev
            else:
                pieces.append(ev.text)
                if not as_json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        assert done is not None  # generate() always ends with the request's Finished
        u = done.usage
        prefill_ms = (u.ttft_s or 0.0) * 1e3
        decode_tok_s = u.decode_tok_s or 0.0
        if edge:
            from partition.offload.offload_chain import offload_stats, offload_summary
        if as_json:
            print_json({"prompt": prompt, "text": "".join(pieces), "backend": backend, "model": str(given),
                        "chat": chat, "dtype": dtype, "activations": decoder_precision(core),
                        "threads": decoder_threads(core), "slices": slices,
                        "kv_cache": kv_cache, "kv_blocks": kv_blocks,
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens, "prefill_ms": round(prefill_ms, 3),
                        "decode_tok_s": round(decode_tok_s, 3), "finish_reason": done.reason,
                        "token_ids": list(done.token_ids),
                        **({"speculate": k, "max_disagreement": max_disagreement,
                            "exit_stats": core.executor.exit_stats()} if exits else {}),  # type: ignore[attr-defined]
                        **({"edge": {**offload_stats(chain), "split": split}} if edge else {})})
        else:
            sys.stdout.write("\n")
            typer.echo(f"prefill {prefill_ms:.1f} ms | decode {decode_tok_s:.1f} tok/s | "
                       f"{u.completion_tokens} tokens ({done.reason})", err=True)
            if edge:
                typer.echo(split, err=True)
                if chain is not None and offload_summary(chain):
                    typer.echo(offload_summary(chain), err=True)


def resolve_speculate(model: Path, speculate: str | None) -> int:
    """--speculate: None/0 -> 0, K -> K, 'auto' -> the K the exit record predicts is fastest."""
    if speculate is None:
        return 0
    if speculate == "auto":
        from agent.engine.speculative import choose_draft
        from partition.config import load_config

        return choose_draft(model, load_config(model).n_layers, None)[1]
    try:
        return int(speculate)
    except ValueError:
        raise ValueError(f"--speculate takes a number of draft tokens or 'auto', got {speculate!r}") from None


def register(app: typer.Typer) -> None:
    app.command()(generate)
