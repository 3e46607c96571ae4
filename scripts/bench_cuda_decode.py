"""GPU benchmark of the PyTorch runner on real model shapes (random weights): prefill ms, decode tok/s
and the memory bandwidth that decode achieves (weights + filled KV read per token / step time), which
is the number that matters physically for a memory-bound decode.

    python scripts/bench_cuda_decode.py --presets llama-3.2-1b,qwen2.5-0.5b,llama-3-8b --json
    python scripts/bench_cuda_decode.py --compare --json      # eager vs CUDA graphs, one run

Run it on a CUDA machine (the lent H200). The achieved GB/s against the device's peak says how much of
the decode step is the runner's overhead rather than memory traffic. `--compare` runs, per preset and
on one model: eager (the reference) with a cache just long enough; CUDA graphs over that whole buffer;
and graphs with a long cache (--long-max-seq), once attending over the whole buffer and once over the
power-of-two past-length bucket, which says whether bucketing is worth its extra captures. The GB/s
counts the same useful bytes for every variant (so its ratio is the speed ratio): full-buffer
attention reads more than that.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from partition.checkpoint import random_model
from partition.config import preset
from partition.model import Transformer
from partition.slices import SliceSpec
from partition.runners.chain import Chain
from partition.runners.torch_runner import TorchRunner


@dataclass(frozen=True)
class Variant:
    name: str
    cuda_graphs: bool
    buckets: bool = True
    long_cache: bool = False  # max_seq = --long-max-seq instead of prompt + steps + 1


EAGER = Variant("eager", False)
GRAPHS = Variant("graphs", True)
COMPARE = (EAGER, Variant("graphs-full", True, buckets=False),
           Variant("graphs-full-long", True, buckets=False, long_cache=True),
           Variant("graphs-bucketed-long", True, buckets=True, long_cache=True))


def run_variant(model: Transformer, v: Variant, prompt_len: int, decode_steps: int, max_seq: int,
                label: str) -> dict:
    cfg = model.config
    chain = Chain([TorchRunner(model, SliceSpec(0, cfg.n_layers, cfg.n_layers), max_seq,
                               cuda_graphs=v.cuda_graphs, graph_buckets=v.buckets)])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len), dtype=np.int32)
    pos = np.arange(prompt_len, dtype=np.int32)[None]
    chain.forward(ids, pos)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = chain.forward(ids, pos)
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    token = int(np.argmax(logits[0]))
    times, tokens = [], []
    for step in tqdm(range(decode_steps), desc=f"{label} {v.name}", file=sys.stderr, leave=False):
        t = time.perf_counter()
        logits = chain.forward(np.array([[token]], dtype=np.int32), np.array([[prompt_len + step]], dtype=np.int32))
        token = int(np.argmax(logits[0]))  # argmax on the host syncs, as a real decode loop does
        times.append(time.perf_counter() - t)
        tokens.append(token)
    step_s = float(np.median(times))  # the median skips the steps that capture a graph
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (prompt_len + decode_steps // 2)
                * model.lm_head.weight.element_size())
    graphs = chain.runners[0].graphs
    del chain
    torch.cuda.empty_cache()
    return {"variant": v.name, "max_seq": max_seq, "prefill_ms": round(prefill_ms, 2),
            "prefill_tok_s": round(prompt_len / prefill_ms * 1e3, 1),
            "decode_ms_per_token": round(step_s * 1e3, 3), "decode_tok_s": round(1 / step_s, 1),
            "achieved_GB_s": round((weight_bytes + kv_bytes) / step_s / 1e9, 1),
            "slowest_step_ms": round(max(times) * 1e3, 1),  # a capture, for graph variants
            "graphs_captured": sorted(graphs.graphs) if graphs else [], "tokens": tokens}


def bench(name: str, dtype: torch.dtype, prompt_len: int, decode_steps: int, variants: tuple[Variant, ...],
          long_max_seq: int) -> dict:
    cfg = preset(name)
    model = random_model(cfg, seed=0, dtype=dtype, device="cuda")
    tight = prompt_len + decode_steps + 1
    rows = [run_variant(model, v, prompt_len, decode_steps, long_max_seq if v.long_cache else tight,
                        name) for v in variants]
    del model
    torch.cuda.empty_cache()
    base, base_tokens = rows[0], rows[0]["tokens"]
    for r in rows:  # ratios against the first variant (eager in --compare)
        r["x_" + base["variant"]] = round(r["decode_tok_s"] / base["decode_tok_s"], 2)
        tokens = r.pop("tokens")
        r["tokens_match_" + base["variant"]] = tokens == base_tokens
        # Random weights give near-flat bf16 logits, so one rounding difference (another attention
        # length, another kernel) can flip an argmax; where it first happens says how soon.
        r["first_token_diff_step"] = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), None)
    return {"preset": name, "dtype": str(dtype).removeprefix("torch."), "params": cfg.n_params,
            "prompt_tokens": prompt_len, "decode_steps": decode_steps, "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=128)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cuda-graphs", action="store_true", help="decode with CUDA graphs only")
    mode.add_argument("--compare", action="store_true", help="eager vs graphs (full and bucketed), one run")
    ap.add_argument("--long-max-seq", type=int, default=8192, help="cache length of the *-long variants")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; run this on a GPU machine")
    variants = COMPARE if args.compare else (GRAPHS,) if args.cuda_graphs else (EAGER,)
    results = [bench(n, getattr(torch, args.dtype), args.prompt_len, args.decode_steps, variants,
                     args.long_max_seq) for n in args.presets.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}")
    print(f"{'preset':14} {'variant':22} {'max_seq':>7} {'prefill ms':>10} {'decode tok/s':>12} "
          f"{'GB/s':>8} {'x base':>7}")
    for res in results:
        for r in res["variants"]:
            ratio = next(v for k, v in r.items() if k.startswith("x_"))
            print(f"{res['preset']:14} {r['variant']:22} {r['max_seq']:7d} {r['prefill_ms']:10.1f} "
                  f"{r['decode_tok_s']:12.1f} {r['achieved_GB_s']:8.1f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
