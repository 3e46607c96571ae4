"""The model's tokenizer (tokenizer.json through the `tokenizers` library) and an incremental decoder
that turns a stream of token ids into text deltas that are always whole characters.

Byte-level BPE splits a multi-byte character across tokens; decoding such a prefix yields U+FFFD.
`IncrementalDecoder` holds text back until the character is complete (the same offsets technique as
vLLM's `detokenize_incrementally`), so every delta is valid UTF-8 on the wire.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from partition.config import ModelConfig, load_config


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class Tokenizer:
    tk: HFTokenizer
    eos_ids: frozenset[int]
    bos_id: int | None = None
    chat_template: str | None = None
    add_bos: bool = False  # tokenizer_config.json's add_bos_token: encode() starts the text with BOS

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: ModelConfig | None = None) -> "Tokenizer":
        """From a model folder (a .gguf file or a model alias: the folder made for it, partition/gguf)."""
        from partition.gguf.folder import is_gguf_ref, resolve_model

        model_dir = resolve_model(model_dir) if is_gguf_ref(model_dir) else Path(model_dir)
        if not model_dir.is_dir():
            raise TokenizerError(f"{model_dir}: no such model folder; give a checkpoint folder with config.json, "
                                 "*.safetensors and tokenizer.json (or leave --model out for the shipped model)")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found; the model folder needs a tokenizer.json "
                                 "(Hugging Face `tokenizers` format)")
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type for bad files
            raise TokenizerError(f"{path}: cannot be read as a tokenizer ({exc})") from None
        if config is None and (model_dir / "config.json").is_file():
            config = load_config(model_dir)
        side = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        eos: set[int] = set(config.eos_token_ids) if config else set()
        gen_eos = gen.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        eos_tok = side.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if isinstance(eos_tok, str) and tk.token_to_id(eos_tok) is not None:
            eos.add(tk.token_to_id(eos_tok))
        bos = config.bos_token_id if config else None
        template = side.get("chat_template")
        add_bos = side.get("add_bos_token") is True and bos is not None
        return cls(tk, frozenset(eos), bos, template if isinstance(template, str) else None, add_bos)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]  # once, also when a chat template already wrote it
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


class IncrementalDecoder:
    """push(token) -> the new text it completes ('' while a character is still partial)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is left at the end of generation (an incomplete character is dropped)."""
        return self._advance(final=True).replace("\ufffd", "")

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            delta = text[len(prefix):]
            # The tokens just emitted become the left context of the next decode.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""
