"""The service on the real GGUF model: a chat request through the official openai client is answered through
the model's own chat template (ChatML for SmolLM2) and ends at its end-of-turn token."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from service_helpers import running_service
from smollm2_helpers import GGUF, requires_smollm2

pytestmark = requires_smollm2
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from partition.gguf.folder import resolve_model

    tmp = tmp_path_factory.mktemp("gguf-svc")
    with running_service(resolve_model(str(GGUF), tmp / "models"), tmp, backend="torch", max_batch=1,
                         max_seq=512, max_output_tokens=64) as s:
        yield s


def test_gguf_chat_request_is_answered_through_the_template(svc) -> None:
    openai = pytest.importorskip("openai")
    from agent.chat import chat_text
    from partition.tokenizer import Tokenizer

    oc = openai.OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0)
    model = oc.models.list().data[0].id
    chat = oc.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                      max_tokens=48, temperature=0)
    tok = Tokenizer.from_dir(svc.cfg.model_dir)
    rendered = chat_text(tok, QUESTION)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert chat.usage.prompt_tokens == len(tok.encode(rendered))  # the prompt the template made, token for token
    answer = chat.choices[0].message.content
    assert "Paris" in answer and "<|im_end|>" not in answer
    assert chat.choices[0].finish_reason == "stop"  # ended at <|im_end|>, not at max_tokens
    # a raw completion of the same words is not a chat: a different prompt length, no template
    comp = oc.completions.create(model=model, prompt=QUESTION, max_tokens=4, temperature=0)
    assert comp.usage.prompt_tokens == len(tok.encode(QUESTION)) < chat.usage.prompt_tokens
