"""Calibrate exit thresholds to a disagreement target with a statistical guarantee (Learn-then-Test,
Angelopoulos et al., arXiv 2110.01052, as CALM uses it, arXiv 2207.07061).

Data: prompts cut from the corpus 'val' split, continued greedily by the full model; then one
teacher-forced pass gives, at every generated position, each exit head's top-1 token and probability
and the full model's token. Teacher forcing measures exactly what decoding with exits sees: the
backlog scheme (runtime.py) keeps every layer's cache exact, so a head's output at a position
depends only on the tokens before it.

The loss of threshold t at layer l on a token: the head's top-1 prob >= t and its token differs from
the full model's. A token that leaves at l counts there only, so the cascade's disagreement is at
most the sum over layers; each layer gets target/L and delta/L (Bonferroni). Per layer, thresholds
are tested from strict to loose (fixed-sequence testing, valid because the loss only grows as t
falls) with the binomial tail p-value P(Bin(n, target/L) <= losses); the lowest threshold before the
first non-rejection is kept (none: that layer never exits). Held-out figures come from the 'test'
split, never from the calibration set.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.stats import binom
from tqdm import tqdm

from partition.checkpoint import load_model
from partition.config import load_config
from partition.exits.data import layer_states, split_texts, token_windows
from partition.exits.heads import ExitHeads, load_heads, read_record, write_record
from partition.runners import load_chain
from partition.tokenizer import Tokenizer

GRID = tuple(float(x) for x in np.round(np.concatenate((1 - np.logspace(-4, -1, 13), np.arange(0.89, 0.29, -0.01))), 5))


@dataclass(frozen=True)
class CalibrateOptions:
    max_disagreement: float = 0.01
    confidence: float = 0.95
    prompts: int = 256  # per set (calibration 'val', held-out 'test')
    prompt_len: int = 24
    new_tokens: int = 32
    batch: int = 16
    seed: int = 0


@dataclass(frozen=True)
class TokenTable:
    """Per generated position: the full model's token, and per exit layer the head's top-1 and its
    probability."""

    full: torch.Tensor  # (N,)
    pred: dict[int, torch.Tensor]  # layer -> (N,)
    conf: dict[int, torch.Tensor]  # layer -> (N,)


@torch.no_grad()
def greedy_continue(model_dir: Path, prompts: torch.Tensor, new_tokens: int, batch: int,
                    progress: bool = True, model: torch.nn.Module | None = None) -> torch.Tensor:
    """prompts (N, P) -> (N, P + new_tokens), continued greedily by the full chain, rows batched.
    (Data collection only: no sampling, no stop rules; real requests go through agent.engine.)
    model: an already-loaded Transformer to run (the torch runner); None: the chain loads the checkpoint."""
    n, p = prompts.shape
    chain = load_chain(model_dir, max_seq=p + new_tokens + 1, max_batch=batch, model=model)
    out = []
    for i in tqdm(range(0, n, batch), desc="greedy decode", unit="batch", file=sys.stderr, disable=not progress):
        rows = prompts[i:i + batch].numpy().astype(np.int32)
        b = rows.shape[0]
        seq = [rows]
        logits = chain.forward(rows, np.arange(p, dtype=np.int32)[None].repeat(b, 0), list(range(b)))
        for t in range(new_tokens):
            nxt = logits.argmax(-1).astype(np.int32)[:, None]  # (B, 1)
            seq.append(nxt)
            if t + 1 < new_tokens:
                logits = chain.forward(nxt, np.full((b, 1), p + t, dtype=np.int32), list(range(b)))
        out.append(torch.from_numpy(np.concatenate(seq, axis=1)).long())
    return torch.cat(out)


@torch.no_grad()
def token_table(model: torch.nn.Module, heads: ExitHeads, seqs: torch.Tensor, prompt_len: int,
                batch: int) -> TokenTable:
    full, pred, conf = [], {l: [] for l in heads.layers}, {l: [] for l in heads.layers}  # type: ignore[var-annotated]
    for i in range(0, seqs.shape[0], batch):
        x = seqs[i:i + batch]
        states, _, logits = layer_states(model, x, heads.layers)  # type: ignore[arg-type]
        sl = slice(prompt_len - 1, x.shape[1] - 1)  # positions whose next token was generated
        full.append(logits[:, sl].argmax(-1).reshape(-1))
        for l, h in states.items():
            probs = torch.softmax(heads(l, h[:, sl]), -1)
            c, a = probs.max(-1)
            pred[l].append(a.reshape(-1))
            conf[l].append(c.reshape(-1))
    return TokenTable(torch.cat(full), {l: torch.cat(v) for l, v in pred.items()},
                      {l: torch.cat(v) for l, v in conf.items()})


def ltt_threshold(conf: torch.Tensor, wrong: torch.Tensor, target: float, delta: float) -> float:
    """The lowest threshold of GRID certified (fixed-sequence, binomial tail) to keep
    P(conf >= t and wrong) <= target with probability >= 1 - delta; inf when none is."""
    n = conf.numel()
    best = float("inf")
    for t in GRID:
        losses = int(((conf >= t) & wrong).sum())
        if binom.cdf(losses, n, target) > delta:
            break
        best = t
    return best


def cascade(table: TokenTable, thresholds: dict[int, float], n_layers: int) -> dict[str, object]:
    """What decoding with these thresholds does on a table: disagreement, exits per layer, mean
    layers run per token."""
    n = table.full.numel()
    left = torch.ones(n, dtype=torch.bool)
    wrong = torch.zeros(n, dtype=torch.bool)
    rates: dict[str, float] = {}
    layers_run = torch.full((n,), float(n_layers))
    for l in sorted(table.pred):
        go = left & (table.conf[l] >= thresholds[l])
        wrong |= go & (table.pred[l] != table.full)
        layers_run[go] = float(l)
        rates[str(l)] = round(float(go.sum()) / n, 4)
        left &= ~go
    rates[str(n_layers)] = round(float(left.sum()) / n, 4)
    return {"tokens": n, "disagreement": round(float(wrong.sum()) / n, 5), "exit_rate_per_layer": rates,
            "mean_layers_per_token": round(float(layers_run.mean()), 3)}


def collect(model_dir: Path, split: str, options: CalibrateOptions, progress: bool) -> TokenTable:
    model = load_model(model_dir, dequantize=True)  # a GGUF's blocks as floats, as train.py reads them
    heads = load_heads(model, model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    seed = options.seed + (0 if split == "val" else 1)
    prompts = token_windows(tokenizer, split_texts(model_dir, split, None, seed), options.prompt_len,
                            options.prompts, seed)
    # decoded by the same dequantised model the table reads (a GGUF's INT4 CPU kernel runs ~0.45 tok/s here)
    seqs = greedy_continue(model_dir, prompts, options.new_tokens, options.batch, progress, model=model)
    return token_table(model, heads, seqs, options.prompt_len, options.batch)


def calibrate(model_dir: str | Path, options: CalibrateOptions = CalibrateOptions(),
              progress: bool = True, more_targets: tuple[float, ...] = ()) -> list[dict[str, object]]:
    """Certify thresholds for options.max_disagreement (and each of more_targets, on the same data)
    on 'val', evaluate them on 'test', and save them in the exit record (replacing older calibrations
    of the same targets)."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    targets = sorted({options.max_disagreement, *more_targets})
    if not all(0 < t < 1 for t in targets) or not 0 < options.confidence < 1:
        raise ValueError("max_disagreement and confidence must be in (0, 1)")
    cal = collect(model_dir, "val", options, progress)
    held = collect(model_dir, "test", options, progress)
    n_layers = load_config(model_dir).n_layers
    k = len(cal.pred)
    delta = 1 - options.confidence
    entries: list[dict[str, object]] = []
    for target in targets:
        thresholds = {l: ltt_threshold(cal.conf[l], cal.pred[l] != cal.full, target / k, delta / k)
                      for l in sorted(cal.pred)}
        entries.append({
            "target": target, "confidence": options.confidence,
            "thresholds": {str(l): (None if t == float("inf") else t) for l, t in thresholds.items()},
            "rule": "top-1 probability of the exit head >= threshold; target/L and delta/L per layer "
                    "(Bonferroni), fixed-sequence test over the threshold grid with binomial tail p-values",
            "calibration_set": {"split": "val", "prompts": options.prompts, "prompt_len": options.prompt_len,
                                "new_tokens": options.new_tokens, **cascade(cal, thresholds, n_layers)},
            "held_out": {"split": "test", "prompts": options.prompts, **cascade(held, thresholds, n_layers)},
            "seconds": round(time.perf_counter() - t0, 1),
        })
    record = read_record(model_dir)
    # what a draft head achieves on decoded text (speculation's acceptance rate), per exit layer
    record["held_out_greedy_top1_agreement"] = {
        str(l): round(float((held.pred[l] == held.full).float().mean()), 4) for l in sorted(held.pred)}
    old = [c for c in record.get("calibrations", []) if c.get("target") not in targets]  # type: ignore[union-attr]
    record["calibrations"] = sorted([*old, *entries], key=lambda c: c["target"])  # type: ignore[index]
    write_record(model_dir, record)
    return entries
