"""Text for the exit heads of a model that has no corpus record of its own (a GGUF file, any downloaded
checkpoint): either a text file the user gives (`--text FILE`: its paragraphs dealt into the splits), or
the model's own seeded generations on a fixed prompt set. Either is written beside the model as a record
(corpus_text.json / corpus_generated.json) that partition/exits/data.py reads like corpus.json, so
training, calibration and their held-out figures use the same splits.

Splits: item i goes to train, val or test by i % 8 (0-5 train, 6 val, 7 test), so the splits never share
a prompt or a paragraph. The generations sample at temperature 0.8 with top-p 0.95 from a fixed seed
(varied text, reproducible); the caller may render each prompt first (an instruct model's chat template:
the text it meets at run time). Generation runs the
dequantised weights (the same numbers as a GGUF's blocks) for speed on the CPU.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from partition.exits.data import GENERATED_RECORD, TEXT_RECORD

SPLITS = ("train",) * 6 + ("val", "test")
PROMPTS = (
    "Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle for a ten-year-old.",
    "Give three tips for learning a new language.", "How does a bicycle stay upright?",
    "Summarise the plot of a mystery novel you invent.", "What is the difference between weather and climate?",
    "Write a polite email asking for a deadline extension.", "Explain what a hash table is.",
    "Why do leaves change colour in autumn?", "Describe a busy market in the morning.",
    "How do vaccines train the immune system?", "Write a recipe for a simple vegetable soup.",
    "What should I pack for a week of hiking?", "Explain recursion with an everyday example.",
    "Why is the sky blue?", "Write a poem about a train at night.",
    "How does compound interest work?", "Describe the life of a honeybee.",
    "What are good habits for a healthy sleep?", "Explain how an electric motor works.",
    "Write a dialogue between a customer and a baker.", "What is photosynthesis?",
    "How do I write a good cover letter?", "Describe the planets of the solar system.",
    "Explain the rules of chess briefly.", "What makes a good team leader?",
    "Write a diary entry from a sailor in 1850.", "How does the internet route a message?",
    "Why do we have time zones?", "Describe how bread rises.",
    "Explain what a budget is and how to make one.", "Write a product description for a rain jacket.",
    "How do earthquakes happen?", "What is the role of a museum?",
    "Explain sorting algorithms in simple terms.", "Describe a thunderstorm from a cat's point of view.",
    "How do plants grow from seeds?", "Write instructions for planting a tree.",
)


def split_of(i: int) -> str:
    return SPLITS[i % len(SPLITS)]


def text_file_corpus(model_dir: Path, text_file: Path) -> Path:
    """TEXT_FILE's paragraphs (blank-line separated) dealt into the splits, recorded beside the model."""
    data = Path(text_file).read_bytes()
    paragraphs = [p.strip() for p in data.decode("utf-8", errors="replace").split("\n\n") if p.strip()]
    if len(paragraphs) < len(SPLITS):
        raise ValueError(f"{text_file}: {len(paragraphs)} paragraphs; need at least {len(SPLITS)} (blank-line "
                         "separated) to give train, val and test text")
    out = Path(model_dir) / TEXT_RECORD
    out.write_text(json.dumps({"source": str(text_file), "sha256": hashlib.sha256(data).hexdigest(),
                               "items": [{"split": split_of(i), "text": p} for i, p in enumerate(paragraphs)]},
                              ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return out


@torch.no_grad()
def generated_corpus(model_dir: Path, render: Callable[[str], str] | None = None, new_tokens: int = 160,
                     seed: int = 0, batch: int = 8, log: Callable[[str], None] | None = None) -> Path:
    """The model's own seeded generations on PROMPTS, recorded beside the model. render: a prompt as the text
    the model is given (an instruct model's chat template: agent.chat.chat_text); None = the prompt itself."""
    from partition.checkpoint import load_model
    from partition.runners import load_chain
    from partition.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    chat = render is not None
    rendered = [render(p) if render is not None else p for p in PROMPTS]
    prompts = [tok.encode(r) for r in rendered]
    longest = max(len(p) for p in prompts) + new_tokens + 1
    model = load_model(model_dir, dequantize=True)
    chain = load_chain(model_dir, backend="torch", model=model, max_batch=batch, max_seq=longest)
    gen = torch.Generator().manual_seed(seed)
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"{model_dir.name}: no corpus beside the model; generating one ({len(PROMPTS)} prompts x {new_tokens} "
        f"tokens, seed {seed}{', through its chat template' if chat else ''})")
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        logits = np.concatenate([chain.forward(np.asarray([p], np.int32), np.arange(len(p), dtype=np.int32)[None],
                                               [row]) for row, p in enumerate(group)])
        out: list[list[int]] = [[] for _ in group]
        done = [False] * len(group)
        for step in range(new_tokens):
            nxt = _sample(torch.from_numpy(logits), gen)
            for r, t in enumerate(nxt):
                if not done[r]:
                    out[r].append(t)
                    done[r] = t in tok.eos_ids
            if all(done):
                break
            pos = np.asarray([[len(p) + step] for p in group], np.int32)
            logits = chain.forward(np.asarray([[o[-1]] for o in out], np.int32), pos, list(range(len(group))))
        outputs += out
    items = [{"split": split_of(i), "prompt": PROMPTS[i],
              "text": rendered[i] + tok.decode([t for t in o if t not in tok.eos_ids])} for i, o in enumerate(outputs)]
    path = model_dir / GENERATED_RECORD
    path.write_text(json.dumps({"source": "generated by the model (dequantised weights)", "seed": seed,
                                "temperature": 0.8, "top_p": 0.95, "new_tokens": new_tokens, "chat_template": chat,
                                "items": items}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path


def _sample(logits: torch.Tensor, gen: torch.Generator, temperature: float = 0.8, top_p: float = 0.95) -> list[int]:
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    sorted_p, order = torch.sort(probs, descending=True, dim=-1)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    pick = torch.multinomial(sorted_p, 1, generator=gen)[:, 0]
    return order.gather(1, pick[:, None])[:, 0].tolist()
