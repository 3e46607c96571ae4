"""A prompt as a chat: the text `generate --chat` (and the demo) feed the model, rendered by the code the
service renders /v1/chat/completions with (agent.api.openai.render_chat: the model's own chat template
in a sandboxed jinja2, given the end-of-turn token as `eos_token`). Generation then stops at that
token, which is one of the tokenizer's eos ids."""
from __future__ import annotations

from partition.tokenizer import Tokenizer


def eos_text(tokenizer: Tokenizer) -> str:
    """The end-of-sequence token's text handed to chat templates as `eos_token` (the lowest eos id's)."""
    eos = min(tokenizer.eos_ids, default=None)
    return (tokenizer.tk.id_to_token(eos) or "") if eos is not None else ""


def chat_text(tokenizer: Tokenizer, user: str, system: str | None = None) -> str:
    """USER as one user message (after SYSTEM, if given) through the model's chat template, with the
    assistant's turn opened."""
    from agent.api.openai import Message, render_chat

    messages = ([Message(role="system", content=system)] if system else []) + [Message(role="user", content=user)]
    return render_chat(tokenizer.chat_template, messages, eos_text(tokenizer))
