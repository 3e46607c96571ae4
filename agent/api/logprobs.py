"""OpenAI's two logprobs objects from the engine's `TokenLogprob`s: the legacy completions one
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat one (`content`, a list of
`{token, logprob, bytes, top_logprobs}`). Token texts come from the tokenizer's decode of one id.
No torch here. The numbers are those of the distribution each token was drawn from (see
agent.engine.executor.token_logprob).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from agent.engine.types import TokenLogprob

TokenText = Callable[[int], str]


def _entry(text: TokenText, token: int, logprob: float) -> dict[str, Any]:
    s = text(token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one stream chunk)."""
    return {"content": [{**_entry(text, e.token, e.logprob),
                         "top_logprobs": [_entry(text, t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> tuple[dict[str, Any], int]:
    """`choices[].logprobs` of a completion (or of one stream chunk, whose `text_offset`s continue
    from `offset`, the characters of completion before it), and the offset after it. As OpenAI's,
    each `top_logprobs` map holds the top alternatives plus the sampled token."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        s = text(e.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top = {text(t): lp for t, lp in e.top}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset
