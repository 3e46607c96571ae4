"""Quality of weight-only quantisation on the shipped model (CPU): held-out perplexity and greedy
agreement of INT8 / INT4 checkpoints written by `orin-agent quantize`, against the floating-point model.

    python scripts/quant_quality.py --tokens 32768 --greedy 256 --json

Perplexity: the first --tokens tokens of the held-out test split (corpus.json beside the model: files
whose sha256 starts with 0 or 1), in windows of --window tokens, every token predicted from its window
(fp32 activations). Greedy: --greedy tokens from each prompt; agreement = share of positions where the
quantised model's token equals the reference's, up to the first difference and overall.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from partition.checkpoint import load_model
from partition.model import Transformer
from partition.paths import DEFAULT_MODEL_DIR
from partition.quantize import default_spec, quantize_checkpoint
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner
from partition.tokenizer import Tokenizer

PROMPTS = ("def parse(", "import os\n", "class Error(Exception):\n")


def held_out_ids(model_dir: Path, tok: Tokenizer, n_tokens: int) -> list[int]:
    corpus = json.loads((model_dir / "corpus.json").read_text())
    root = Path(corpus["stdlib_dir"])
    ids: list[int] = []
    for r in corpus["files"]:
        if r["split"] == "test" and not r["path"].startswith("encodings/"):
            ids += tok.encode((root / r["path"]).read_text(encoding="utf-8"))
            if len(ids) >= n_tokens:
                break
    return ids[:n_tokens]


@torch.inference_mode()
def perplexity(model: Transformer, ids: list[int], window: int) -> float:
    cfg = model.config
    sl = model.slice(0, cfg.n_layers, all_logits=True)
    empty = [torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim)] * (2 * cfg.n_layers)
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[s:s + window + 1], dtype=torch.int32)
        x, y = chunk[:-1][None], chunk[1:].long()
        logits = sl(x, torch.arange(x.shape[1], dtype=torch.int32)[None], *empty)[0][0]
        nll += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum").item()
        n += y.numel()
    return math.exp(nll / n)


def greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    n = model.config.n_layers
    runner = TorchRunner(model, SliceSpec(0, n, n), len(prompt) + steps + 1)
    logits = runner.run(np.array([prompt], np.int32), np.arange(len(prompt), dtype=np.int32)[None])
    out = []
    for i in range(steps):
        out.append(int(torch.argmax(logits[0])))
        logits = runner.run(np.array([[out[-1]]], np.int32), np.array([[len(prompt) + i]], np.int32))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--greedy", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model_dir = Path(args.model)
    tok = Tokenizer.from_dir(model_dir)
    ids = held_out_ids(model_dir, tok, args.tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"fp (fp16 on disk, fp32 run)": model_dir}
        for bits in (8, 4):
            spec = default_spec(bits)
            dirs[f"int{bits} {'per channel' if spec.group_size == -1 else f'g{spec.group_size}'}"] = Path(
                quantize_checkpoint(model_dir, Path(tmp) / f"q{bits}", spec).out_dir)
        ref_tokens: list[list[int]] = []
        for name, d in dirs.items():
            model = load_model(d)
            ppl = perplexity(model, ids, args.window)
            toks = [greedy(model, tok.encode(p), args.greedy) for p in PROMPTS]
            if not ref_tokens:
                ref_tokens = toks
            same = [sum(a == b for a, b in zip(t, r)) for t, r in zip(toks, ref_tokens)]
            first = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t)) for t, r in zip(toks, ref_tokens)]
            rows.append({"weights": name, "ppl": round(ppl, 4), "greedy_agreement": round(sum(same) / sum(map(len, toks)), 4),
                         "first_diff": first})
    base = rows[0]["ppl"]
    for r in rows:
        r["ppl_delta_pct"] = round(100 * (r["ppl"] / base - 1), 2)
    out = {"model": str(model_dir), "held_out_tokens": len(ids), "window": args.window,
           "greedy_tokens_per_prompt": args.greedy, "prompts": PROMPTS, "rows": rows}
    print(json.dumps(out, indent=1) if args.json else "\n".join(map(str, rows)))


if __name__ == "__main__":
    main()
