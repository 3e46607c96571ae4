"""A GGUF file's tokenizer as a `tokenizers` Tokenizer (what partition/tokenizer.py loads from
tokenizer.json), built from the vocabulary, merges, scores and token types in its metadata, plus the
side facts the runtime needs (bos / eos / end-of-turn ids, whether to add BOS, the chat template).

Two vocabularies (`tokenizer.ggml.model`):
  gpt2   byte-level BPE. The pre-tokenizer depends on `tokenizer.ggml.pre`, as in llama.cpp's
         src/llama-vocab.cpp (regex_exprs per LLAMA_VOCAB_PRE_TYPE_*): `smollm` (and starcoder,
         refact, command-r, codeshell, exaone) split every digit off first, then the GPT-2 regex;
         `default` / `gpt-2` the GPT-2 regex; `llama3` / `llama-bpe` and `qwen2` their own split
         regexes (the strings transformers' integrations/gguf/gguf_tokenizer_mapping.py uses).
  llama  SentencePiece-style BPE over `▁`-marked pieces with byte fallback (`<0x0A>` tokens); merges
         from the file or, when it has none, derived from the vocabulary ranked by score (the
         derivation of transformers' tokenization_utils_base.generate_merges).
Control tokens (token type 3) become special added tokens and user-defined ones (type 4) plain added
tokens, so `<|im_start|>` stays one token in a rendered chat.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf-py constants TokenType)

_GPT2_PRES = ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")
_DIGIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
SUPPORTED_PRES = (*_GPT2_PRES, *_DIGIT_PRES, *_SPLITS)


class GGUFTokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTokenizer:
    """The tokenizer and what partition.tokenizer.Tokenizer reads beside tokenizer.json."""

    tk: Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]  # eos, then end-of-turn / end-of-message where the file names them
    add_bos: bool
    chat_template: str | None

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json's keys that partition/tokenizer.py reads."""
        name = self.tk.id_to_token
        out: dict[str, Any] = {"add_bos_token": self.add_bos}
        if self.bos_id is not None:
            out["bos_token"] = name(self.bos_id)
        if self.eos_ids:
            out["eos_token"] = name(self.eos_ids[0])
        if self.chat_template:
            out["chat_template"] = self.chat_template
        return out


def _byte_level(tokens: list[str], merges: list[str], pre: str, source: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False))
    if pre in _GPT2_PRES:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGIT_PRES:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported (a wrong pre-tokenizer "
                                 f"splits text differently from training); supported: {', '.join(SUPPORTED_PRES)}")
    tk.decoder = decoders.ByteLevel()
    return tk


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores scores, not merges: every split of a token into two vocabulary pieces is a
    merge, ranked by the merged token's score, then the pieces' lengths (both higher first); within one
    token by the pieces' ids. The order of transformers' tokenization_utils_base.generate_merges."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for tok, score in zip(tokens, scores):
        local = sorted(((tok[:c], tok[c:]) for c in range(1, len(tok)) if tok[:c] in vocab and tok[c:] in vocab),
                       key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((left, right, score) for left, right in local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep the order above
    return [(m[0], m[1]) for m in found]


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None,
                   add_space_prefix: bool, source: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif scores:
        pairs = derive_merges(tokens, scores)
    else:
        raise GGUFTokenizerError(f"{source}: a 'llama' vocabulary with neither merges nor scores")
    unk = "<unk>" if "<unk>" in vocab else None
    tk = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def build_tokenizer(meta: dict[str, Any], source: str) -> GGUFTokenizer:
    """The tokenizer a GGUF file's metadata (partition.gguf.reader.metadata) describes."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError(f"{source}: no tokenizer.ggml.tokens: the file carries no vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise GGUFTokenizerError(f"{source}: a byte-level (gpt2) vocabulary without tokenizer.ggml.merges")
        tk = _byte_level(tokens, merges, str(meta.get("tokenizer.ggml.pre", "default")), source)
        add_bos_default = False
    elif kind == "llama":
        tk = _sentencepiece(tokens, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.scores"),
                            bool(meta.get("tokenizer.ggml.add_space_prefix", True)), source)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2 "
                                 "byte-level BPE, llama SentencePiece-style BPE)")
    # Added tokens match whole in the text before the model splits it; each keeps its id in the vocabulary
    # (the vocabulary holds the token's own spelling, so adding it never grows the vocabulary).
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
    tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(tk, None if bos is None else int(bos), tuple(dict.fromkeys(eos)),
                         bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                         template if isinstance(template, str) else None)


def tokenizer_json(tok: GGUFTokenizer) -> str:
    """tokenizer.json's text (pretty-printed, as `tokenizers` saves it)."""
    return json.dumps(json.loads(tok.tk.to_str()), ensure_ascii=False, indent=2)
