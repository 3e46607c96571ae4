"""The text exit heads are trained, calibrated and evaluated on: the model's own corpus record
(corpus.json: which stdlib files, their sha256 and their train / val / test split), read from this
machine's standard library. A file whose bytes differ from the record is skipped, so the splits are
the ones the model was trained with: heads train on `train`, calibration uses `val`, held-out
figures come from `test`. A model without one (a GGUF file, a downloaded checkpoint) uses the record
partition/exits/corpus.py writes beside it: a text file's paragraphs or the model's own generations.

Also the teacher-forced pass that gives every exit layer's hidden state and the final logits.
"""
from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from partition.model import Transformer, attention_mask, rope_cos_sin
from partition.tokenizer import Tokenizer


class CorpusError(ValueError):
    """The corpus record is missing or none of its files is on this machine."""


# The records partition/exits/corpus.py writes beside a model that has no corpus.json (read here, written there)
TEXT_RECORD = "corpus_text.json"
GENERATED_RECORD = "corpus_generated.json"


def record_texts(model_dir: Path, split: str) -> list[str] | None:
    """The texts of one split from a text-file or generated record beside the model; None if neither."""
    for name in (TEXT_RECORD, GENERATED_RECORD):
        path = Path(model_dir) / name
        if path.is_file():
            items = json.loads(path.read_text(encoding="utf-8"))["items"]
            return [it["text"] for it in items if it["split"] == split]
    return None


def benchmark_texts(model_dir: Path, text_file: Path | None = None) -> tuple[list[str], str]:
    """Held-out text for a quality benchmark (scripts/bench_kv.py, scripts/quant_quality.py) of a model with no
    corpus.json, and where it came from: TEXT_FILE's whole text, else the 'test' split of the record beside the
    model (corpus_text.json / corpus_generated.json, in record order); CorpusError saying what to do if neither."""
    if text_file is not None:
        if not Path(text_file).is_file():
            raise CorpusError(f"--text {text_file}: no such file")
        text = Path(text_file).read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise CorpusError(f"--text {text_file}: the file is empty")
        return [text], str(text_file)
    texts = record_texts(Path(model_dir), "test")
    if not texts:
        raise CorpusError(f"{model_dir}: no held-out text (no corpus.json, and no corpus record with a 'test' split "
                          "beside the model); pass --text FILE, or run `orin-agent train-exits --model ...` first "
                          "(it records the model's own generations)")
    return texts, f"the 'test' split of {corpus_source(Path(model_dir))}"


def corpus_source(model_dir: Path) -> str:
    """Which record the splits come from, for the heads' record."""
    for name in ("corpus.json", TEXT_RECORD, GENERATED_RECORD):
        if (Path(model_dir) / name).is_file():
            return name
    return "none"


def split_texts(model_dir: Path, split: str, max_files: int | None = None, seed: int = 0) -> list[str]:
    """Texts of the corpus files of one split that are on this machine unchanged (a seeded sample of
    at most max_files of them)."""
    record_path = Path(model_dir) / "corpus.json"
    if not record_path.is_file():
        texts = record_texts(Path(model_dir), split)
        if texts is None:
            raise CorpusError(f"{record_path}: no corpus record beside the model; run `orin-agent train-exits` "
                              "(it writes one from the model's own generations) or pass --text FILE")
        random.Random(seed).shuffle(texts)
        if not texts:
            raise CorpusError(f"{model_dir}: the corpus record beside the model has no '{split}' text")
        return texts[:max_files] if max_files is not None else texts
    record = json.loads(record_path.read_text(encoding="utf-8"))
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in record["files"] if f["split"] == split]
    random.Random(seed).shuffle(files)
    texts = []
    for f in files:
        path = root / f["path"]
        if not path.is_file():
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            continue
        texts.append(data.decode("utf-8", errors="replace"))
        if max_files is not None and len(texts) >= max_files:
            break
    if not texts:
        raise CorpusError(f"none of the {len(files)} '{split}' files of {record_path} is on this machine "
                          f"unchanged under {root} (the record is for Python {record.get('python_version')})")
    return texts


def token_windows(tokenizer: Tokenizer, texts: list[str], seq_len: int, n: int, seed: int = 0) -> Tensor:
    """n windows of seq_len token ids (int64), cut at seeded random offsets from the texts' stream."""
    sep = tokenizer.eos_ids and min(tokenizer.eos_ids)
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t) + ([sep] if sep is not None else [])
    if len(stream) <= seq_len:
        raise CorpusError(f"only {len(stream)} tokens of text: need more than {seq_len}")
    ids = torch.tensor(stream, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len, (n,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def empty_past(model: Transformer, n_layers: int, batch: int) -> list[Tensor]:
    cfg = model.config
    param = next(model.parameters())
    shape = (batch, cfg.n_kv_heads, 0, cfg.head_dim)
    return [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(2 * n_layers)]


@torch.no_grad()
def layer_states(model: Transformer, ids: Tensor, layers: tuple[int, ...]) -> tuple[dict[int, Tensor], Tensor, Tensor]:
    """Teacher-forced pass over ids (B, T): hidden states (B, T, D) after each of `layers`, the last
    layer's state before the final norm (B, T, D), and the full model's float32 logits (B, T, V).
    The early layers run as the runners' SliceModules; the last range's layers are stepped here so
    the pre-norm state is kept (the same layer modules, the same mask and RoPE)."""
    n = model.config.n_layers
    b, t = ids.shape
    pos = torch.arange(t, dtype=torch.int32, device=ids.device).expand(b, t)
    cuts = [0, *layers]
    x: Tensor = ids.to(torch.int32)
    states: dict[int, Tensor] = {}
    for a, e in zip(cuts, cuts[1:]):
        x = model.slice(a, e)(x, pos, *empty_past(model, e - a, b))[0]
        states[e] = x
    if not layers:
        x = model.model.embed_tokens(x)
    cos, sin = rope_cos_sin(model.inv_freq, pos, x.dtype)
    mask = attention_mask(pos, 0)
    none = empty_past(model, 1, b)
    for layer in model.model.layers[cuts[-1]:n]:
        x = layer(x, cos, sin, mask, none[0], none[1])[0]
    return states, x, model.lm_head(model.model.norm(x)).float()


def held_out_prompts(model_dir: Path, tokenizer: Tokenizer, prompt_len: int, n: int) -> list[list[int]]:
    """The benchmarks' prompts: n windows of prompt_len tokens from the `test` split (seed 7)."""
    return token_windows(tokenizer, split_texts(model_dir, "test", None, 7), prompt_len, n, 7).tolist()


@torch.no_grad()
def greedy_disagreement(model: Transformer, prompt: list[int], out: tuple[int, ...]) -> int:
    """Emitted tokens that differ from the full model's greedy token on the same prefix (one
    teacher-forced full-depth pass over prompt + out)."""
    ids = torch.tensor([prompt + list(out)])
    _, _, logits = layer_states(model, ids, ())
    full = logits[0, len(prompt) - 1:len(prompt) - 1 + len(out)].argmax(-1)
    return int((full != torch.tensor(out)).sum())
