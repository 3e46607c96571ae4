#!/usr/bin/env python3
"""Decode tok/s and prefill ms of the torch and ONNX Runtime runners on the same model, side by side
in one run, with the ratio. Greedy decoding from a fixed random prompt; both backends must produce
the same tokens (checked and reported).

Default model: the shipped one (partition.paths.DEFAULT_MODEL_DIR). When its weights are not there
yet, the shipped model's config with random weights stands in (said on stderr and in the JSON).
`--sweep` also times ORT session variants (threads, spinning, IO binding, past mode) to explain the
ratio. Results and exact commands: docs/BENCHMARKS.md.

    python scripts/bench_backends.py [--model DIR] [--prompt 64] [--decode 128] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partition.config import ModelConfig
from partition.paths import DEFAULT_MODEL_DIR
from partition.runners import Chain, load_chain
from partition.runners.ort_runner import OrtOptions

# The shipped model's shape (scripts/train_small_model.py, model_config): d=384, 8 layers, 6 heads of
# 64, 2 KV heads, SwiGLU 640, tied 6144-token embedding, 1024 positions.
SHIPPED_SHAPE = ModelConfig("LlamaForCausalLM", 6144, 384, 8, 6, 2, 64, 640, max_position_embeddings=1024,
                            tie_word_embeddings=True)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_or_stand_in(model_dir: Path, tmp: Path) -> tuple[Path, bool]:
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return model_dir, False
    from partition.checkpoint import random_model, save_model

    _log(f"note: {model_dir} has no weights yet: benchmarking RANDOM weights with the shipped model's "
         "shape (same speed, meaningless text)")
    save_model(random_model(SHIPPED_SHAPE, seed=0), tmp / "stand-in")
    return tmp / "stand-in", True


def run_once(chain: Chain, prompt: np.ndarray, n_decode: int) -> tuple[float, float, list[int]]:
    """(prefill ms, decode tok/s, tokens) for one greedy generation from a fresh cache."""
    t = prompt.shape[1]
    start = time.perf_counter()
    logits = chain.forward(prompt, np.arange(t, dtype=np.int32)[None])
    prefill_ms = (time.perf_counter() - start) * 1e3
    tokens = [int(logits.argmax())]
    start = time.perf_counter()
    for i in range(n_decode):
        logits = chain.forward(np.array([[tokens[-1]]], np.int32), np.array([[t + i]], np.int32))
        tokens.append(int(logits.argmax()))
    return prefill_ms, n_decode / (time.perf_counter() - start), tokens


def _worker(conn: Any, model_dir: str, backend: str, slices: str | None, max_seq: int | None, cache: str,
            opts: OrtOptions | None, prompt: np.ndarray, n_decode: int) -> None:
    """Holds one chain; runs one timed generation per "run" message until "stop"."""
    chain = load_chain(Path(model_dir), backend, slices, max_seq=max_seq, cache_dir=Path(cache), options=opts)
    run_once(chain, prompt[:, :8], 8)  # warm-up: first-run allocations, ORT's memory planning
    conn.send("ready")
    while conn.recv() == "run":
        conn.send(run_once(chain, prompt, n_decode))


def summarise(runs: list[tuple[float, float, list[int]]]) -> dict[str, Any]:
    return {"prefill_ms": statistics.median(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs),
            "decode_tok_s_all": [round(r[1], 1) for r in runs], "tokens": runs[-1][2]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--slices", default=None, help="e.g. 0:4,4:8 (default: one slice)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill length)")
    p.add_argument("--decode", type=int, default=128, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seq", type=int, default=None, help="KV-cache length (default: the model's)")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: cores)")
    p.add_argument("--past-mode", choices=["prefix", "full"], default=OrtOptions.past_mode)
    p.add_argument("--sweep", action="store_true", help="also time ORT option variants")
    p.add_argument("--cache-dir", type=Path, default=None, help="ONNX build cache (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="orin-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir, stand_in = model_or_stand_in(args.model, tmp)
        cache = args.cache_dir or tmp / "builds"
        from partition.config import load_config

        cfg = load_config(model_dir)
        prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.prompt), dtype=np.int32)
        base = OrtOptions(threads=args.threads, past_mode=args.past_mode)
        variants: list[tuple[str, str, OrtOptions | None]] = [("torch", "torch", None), ("ort", "ort", base)]
        if args.sweep:
            for name, change in [("ort threads=1", {"threads": 1}), ("ort threads=2", {"threads": 2}),
                                 ("ort threads=2 spinning", {"threads": 2, "spinning": True}),
                                 ("ort io_binding=off", {"io_binding": False}),
                                 ("ort past_mode=full", {"past_mode": "full"}),
                                 ("ort graph_opt=basic", {"graph_optimization": "basic"})]:
                variants.append((name, "ort", dataclasses.replace(base, **change)))
        # One worker process per variant, driven round-robin, one generation at a time: torch's
        # OpenMP pool and ORT's pool in one process fight over the 2 cores (torch fell to ~17 tok/s
        # next to ORT sessions in one process), and the machine is shared, so interleaving lets load
        # from other processes land on every variant alike instead of skewing the ratio.
        ctx = mp.get_context("spawn")
        workers: dict[str, Any] = {}
        for i, (name, backend, opts) in enumerate(variants, 1):
            _log(f"[{i}/{len(variants)}] loading {name}" + (" (exports the slices once)" if i == 2 else ""))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, str(model_dir), backend, args.slices, args.max_seq,
                                                     str(cache), opts, prompt, args.decode), daemon=True)
            proc.start()
            if parent.recv() != "ready":
                raise SystemExit(f"{name}: worker failed to load")
            workers[name] = (proc, parent)
        runs: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in workers}
        for rep in range(args.repeats):
            for name, (_, conn) in workers.items():
                conn.send("run")
                runs[name].append(conn.recv())
            _log(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
                f"{n} {r[-1][1]:.0f} tok/s" for n, r in runs.items()))
        for proc, conn in workers.values():
            conn.send("stop")
            proc.join(timeout=10)
        results = {name: summarise(r) for name, r in runs.items()}

    ref = results["torch"]
    ref_tokens = ref["tokens"]
    for r in results.values():
        r["decode_ratio_vs_torch"] = r["decode_tok_s"] / ref["decode_tok_s"]
        r["prefill_ratio_vs_torch"] = ref["prefill_ms"] / r["prefill_ms"]
        r["same_tokens_as_torch"] = r.pop("tokens") == ref_tokens
    report = {
        "model": str(args.model), "random_stand_in": stand_in, "config": cfg.to_dict(),
        "slices": args.slices or f"0:{cfg.n_layers}", "prompt_tokens": args.prompt,
        "decode_steps": args.decode, "repeats": args.repeats,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "onnxruntime": __import__("onnxruntime").__version__},
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "ort_options": dataclasses.asdict(base),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'backend':<22}{'prefill ms':>12}{'decode tok/s':>15}{'decode x torch':>16}  same tokens")
    for name, r in results.items():
        print(f"{name:<22}{r['prefill_ms']:>12.1f}{r['decode_tok_s']:>15.1f}{r['decode_ratio_vs_torch']:>16.2f}"
              f"  {r['same_tokens_as_torch']}")
    print(f"({'random weights, ' if stand_in else ''}{args.prompt}-token prompt, {args.decode} decode steps, "
          f"median of {args.repeats} interleaved runs, {report['machine']['cpus']} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
