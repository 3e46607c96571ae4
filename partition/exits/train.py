"""Distil exit heads on a frozen model: each head's translator learns to make
softmax(lm_head(norm(A h_l + b))) match the last layer's distribution (KL(final || head), the tuned
lens objective, arXiv 2303.08112), on teacher-forced windows of the model's own training split. The
backbone, final norm and LM head never change; only A and b per exit layer do.

Held-out agreement (test split): how often each head's top-1 equals the full model's, with the plain
logit lens (A = I, b = 0) beside it as the baseline the translator must beat.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from partition.checkpoint import load_model
from partition.exits.data import corpus_source, layer_states, split_texts, token_windows
from partition.exits.heads import ExitHeads, read_record, write_record
from partition.model import Transformer
from partition.tokenizer import Tokenizer


@dataclass(frozen=True)
class TrainOptions:
    layers: tuple[int, ...] = (2, 4, 6)
    steps: int = 40
    lstsq_windows: int = 32  # least-squares start: A, b regress h_l onto the last layer's state
    batch: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    train_files: int = 200  # a seeded sample of the train split: enough text for steps * batch windows
    eval_windows: int = 32
    device: str = "cpu"
    seed: int = 0


@dataclass(frozen=True)
class TrainResult:
    heads_path: Path
    record_path: Path
    agreement: dict[int, float]  # held-out top-1 agreement with the full model, per exit layer
    lens_agreement: dict[int, float]  # the same with the untrained logit lens
    seconds: float


def default_layers(n_layers: int) -> tuple[int, ...]:
    """Every quarter of the depth: 2, 4, 6 for 8 layers."""
    return tuple(sorted({max(1, round(n_layers * f)) for f in (0.25, 0.5, 0.75)} - {n_layers}))


@torch.no_grad()
def agreement(model: Transformer, heads: ExitHeads, windows: torch.Tensor, batch: int,
              identity: bool = False) -> dict[int, float]:
    hits = {l: 0 for l in heads.layers}
    total = 0
    for i in range(0, windows.shape[0], batch):
        states, _, logits = layer_states(model, windows[i:i + batch], heads.layers)
        full = logits.argmax(-1)
        total += full.numel()
        for l, h in states.items():
            pred = heads._norm[1](heads._norm[0](h)).argmax(-1) if identity else heads(l, h).argmax(-1)
            hits[l] += int((pred == full).sum())
    return {l: hits[l] / total for l in heads.layers}


@torch.no_grad()
def fit_lstsq(model: Transformer, heads: ExitHeads, windows: torch.Tensor, batch: int) -> None:
    """Start each translator at the least-squares map from h_l to the last layer's pre-norm state:
    one linear solve instead of most of the KL steps (which then fix what the norm and head bend)."""
    feats: dict[int, list[torch.Tensor]] = {l: [] for l in heads.layers}
    targets: list[torch.Tensor] = []
    for i in range(0, windows.shape[0], batch):
        states, final, _ = layer_states(model, windows[i:i + batch], heads.layers)
        targets.append(final.reshape(-1, final.shape[-1]))
        for l in heads.layers:
            feats[l].append(states[l].reshape(-1, final.shape[-1]))
    y = torch.cat(targets)  # (N, D)
    for l in heads.layers:
        x = torch.cat(feats[l])
        x = torch.cat((x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)), dim=1)  # (N, D + 1)
        sol = torch.linalg.lstsq(x, y).solution  # (D + 1, D)
        heads.weight[str(l)].copy_(sol[:-1].T)
        heads.bias[str(l)].copy_(sol[-1])


def train_exits(model_dir: str | Path, options: TrainOptions = TrainOptions(), progress: bool = True) -> TrainResult:
    """Train, evaluate and save exit heads beside the model; returns where and how well."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    torch.manual_seed(options.seed)
    # a GGUF's blocks dequantised: the same numbers, and the CPU INT4 kernel is slow for training-sized batches
    # (top-1 equal to the INT4 model at every position of SmolLM2's held-out text, tests/test_gguf_smollm2.py)
    model = load_model(model_dir, device=options.device, dequantize=True).requires_grad_(False)
    tokenizer = Tokenizer.from_dir(model_dir)
    heads = ExitHeads(model, options.layers)
    train = token_windows(tokenizer, split_texts(model_dir, "train", options.train_files, options.seed),
                          options.seq_len, options.steps * options.batch, options.seed).to(options.device)
    held = token_windows(tokenizer, split_texts(model_dir, "test", None, options.seed), options.seq_len,
                         options.eval_windows, options.seed + 1).to(options.device)
    fit_lstsq(model, heads, train[:options.lstsq_windows], options.batch)
    opt = torch.optim.AdamW(heads.parameters(), lr=options.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, options.steps)
    bar = tqdm(range(options.steps), desc="exit heads", unit="step", file=sys.stderr, disable=not progress)
    losses: list[float] = []
    for step in bar:
        x = train[step * options.batch:(step + 1) * options.batch]
        with torch.no_grad():
            states, _, logits = layer_states(model, x, options.layers)
        target = F.log_softmax(logits, -1).reshape(-1, logits.shape[-1])
        loss = torch.zeros((), device=options.device)
        for l, h in states.items():
            pred = F.log_softmax(heads(l, h), -1).reshape(-1, logits.shape[-1])
            loss = loss + F.kl_div(pred, target, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item() / len(options.layers))
        bar.set_postfix(kl=f"{losses[-1]:.3f}")
    heads.eval()
    agree = agreement(model, heads, held, options.batch)
    lens = agreement(model, heads, held, options.batch, identity=True)
    heads_path = heads.save(model_dir)
    seconds = time.perf_counter() - t0
    record = read_record(model_dir)
    record.update({
        "layers": list(options.layers),
        "head": "affine translator A h + b (A initialised to I) -> shared final norm -> shared LM head",
        "objective": "KL(full model || head), backbone frozen",
        "data": {"train": f"{options.steps * options.batch} windows of {options.seq_len} tokens from "
                          f"{options.train_files} files of the corpus 'train' split ({corpus_source(model_dir)}), seed {options.seed}",
                 "held_out": f"{options.eval_windows} windows of {options.seq_len} tokens of the 'test' split"},
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()},
        "final_kl_per_head": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
        "held_out_top1_agreement": {str(l): round(a, 4) for l, a in agree.items()},
        "held_out_top1_agreement_logit_lens": {str(l): round(a, 4) for l, a in lens.items()},
        "train_seconds": round(seconds, 1),
        "calibrations": [],  # thresholds belong to these heads: a retrain drops the old ones
    })
    record_path = write_record(model_dir, record)
    return TrainResult(heads_path, record_path, agree, lens, seconds)
