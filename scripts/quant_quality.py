"""Quality of weight-only quantisation on the shipped model or any `--model` (folder, .gguf file, alias), CPU:
held-out perplexity and greedy agreement of INT8 / INT4 checkpoints written by `orin-agent quantize`, against
the floating-point model.

    python scripts/quant_quality.py --tokens 32768 --greedy 256 --json

Perplexity: the first --tokens tokens of the held-out test split (corpus.json beside the model: files
whose sha256 starts with 0 or 1; without one, `--text FILE` or the 'test' split of the corpus record
`orin-agent train-exits` writes beside the model), in windows of --window tokens, every token predicted from its
window (fp32 activations). Greedy: --greedy tokens from each prompt; agreement = share of positions where the
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
from partition.config import load_config
from partition.gguf.folder import gguf_source, resolve_model
from partition.model import Transformer
from partition.paths import DEFAULT_MODEL_DIR
from partition.quantize import default_spec, quantize_checkpoint
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner
from partition.tokenizer import Tokenizer

PROMPTS = ("def parse(", "import os\n", "class Error(Exception):\n")


def held_out_ids(model_dir: Path, tok: Tokenizer, n_tokens: int, text_file: Path | None = None) -> list[int]:
    """The first n_tokens of the held-out text: the shipped model's test files (corpus.json); for a model
    without one (a GGUF file), --text FILE or its corpus record's 'test' split (benchmark_texts)."""
    if text_file is not None or not (model_dir / "corpus.json").is_file():
        from partition.exits.data import CorpusError, benchmark_texts

        try:
            texts = benchmark_texts(model_dir, text_file)[0]
        except CorpusError as exc:
            raise SystemExit(str(exc)) from None
        sep = [min(tok.eos_ids)] if tok.eos_ids else []
        return [t for text in texts for t in tok.encode(text) + sep][:n_tokens]
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
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint folder, .gguf file or alias")
    ap.add_argument("--text", type=Path, default=None, help="held-out text file (default: corpus.json's test "
                    "split, or for a model without one the 'test' split of the corpus record train-exits wrote)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--greedy", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_dir(model_dir)
    ids = held_out_ids(model_dir, tok, args.tokens, args.text)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"fp (GGUF blocks dequantised, fp32 run)" if gguf_source(model_dir) else "fp (fp16 on disk, fp32 run)": model_dir}
        cfg = load_config(model_dir)
        for bits in (8, 4):
            # INT4's default group of 128 where it divides every projection's input (the shipped model), else 64
            # (SmolLM2: 576 = 9 x 64), as `orin-agent quantize --group` would be told
            g4 = next(g for g in (128, 64, 32) if cfg.hidden_size % g == 0 and cfg.intermediate_size % g == 0)
            spec = default_spec(bits, None if bits == 8 else g4)
            dirs[f"int{bits} {'per channel' if spec.group_size == -1 else f'g{spec.group_size}'}"] = Path(
                quantize_checkpoint(model_dir, Path(tmp) / f"q{bits}", spec).out_dir)
        ref_tokens: list[list[int]] = []
        for name, d in dirs.items():
            model = load_model(d, dequantize=True)  # a GGUF's blocks as floats: its numbers, fast teacher forcing
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
