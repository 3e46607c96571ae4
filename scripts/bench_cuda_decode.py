"""GPU benchmark of the PyTorch runner on real model shapes (random weights): prefill ms, decode tok/s
and the memory bandwidth that decode achieves (weights + KV read per token / step time), which is the
number that matters physically for a memory-bound decode.

    python scripts/bench_cuda_decode.py --presets llama-3.2-1b,qwen2.5-0.5b,llama-3-8b --json

Run it on a CUDA machine (the lent H200). The achieved GB/s against the device's peak says how much of
the decode step is the runner's overhead rather than memory traffic.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from partition.checkpoint import random_model
from partition.config import preset
from partition.runners.base import SliceSpec
from partition.runners.chain import Chain
from partition.runners.torch_runner import TorchRunner


def bench(name: str, dtype: torch.dtype, prompt_len: int, decode_steps: int, device: str) -> dict:
    cfg = preset(name)
    model = random_model(cfg, seed=0, dtype=dtype, device=device)
    max_seq = prompt_len + decode_steps + 1
    chain = Chain([TorchRunner(model, SliceSpec(0, cfg.n_layers, cfg.n_layers), max_seq)])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len), dtype=np.int32)
    pos = np.arange(prompt_len, dtype=np.int32)[None]
    chain.forward(ids, pos)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = chain.forward(ids, pos)
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    token = int(np.argmax(logits[0]))
    times = []
    for step in tqdm(range(decode_steps), desc=f"{name} decode", file=sys.stderr, leave=False):
        t = time.perf_counter()
        logits = chain.forward(np.array([[token]], dtype=np.int32), np.array([[prompt_len + step]], dtype=np.int32))
        token = int(np.argmax(logits[0]))  # argmax on the host syncs, as a real decode loop does
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (prompt_len + decode_steps // 2) * model.lm_head.weight.element_size()
    del chain, model
    torch.cuda.empty_cache()
    return {"preset": name, "dtype": str(dtype).removeprefix("torch."), "params": cfg.n_params,
            "prompt_tokens": prompt_len, "prefill_ms": round(prefill_ms, 2),
            "prefill_tok_s": round(prompt_len / prefill_ms * 1e3, 1),
            "decode_ms_per_token": round(step_s * 1e3, 3), "decode_tok_s": round(1 / step_s, 1),
            "achieved_GB_s": round((weight_bytes + kv_bytes) / step_s / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; run this on a GPU machine")
    rows = [bench(n, getattr(torch, args.dtype), args.prompt_len, args.decode_steps, "cuda")
            for n in args.presets.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.json:
        print(json.dumps({"meta": meta, "results": rows}, indent=2))
        return
    print(f"{meta['device']}, torch {meta['torch']}")
    print(f"{'preset':14} {'prefill ms':>10} {'decode tok/s':>12} {'GB/s':>8}")
    for r in rows:
        print(f"{r['preset']:14} {r['prefill_ms']:10.1f} {r['decode_tok_s']:12.1f} {r['achieved_GB_s']:8.1f}")


if __name__ == "__main__":
    main()
