"""The OpenAI wire format into the engine's types, without a model: a body parses into one
`SamplingParams`, and every refusal is an `InvalidRequest` naming the field (the API's 400)."""
from __future__ import annotations

import json

import pytest

from agent.api.openai import BadRequest, Limits, parse_request
from agent.engine.types import InvalidRequest, SamplingParams


class CharTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


LIMITS = Limits(context=64, max_prompt_tokens=40, max_output_tokens=32, default_max_tokens=16)


def parse(body: dict, kind: str = "completion"):
    return parse_request(kind, json.dumps(body).encode(), CharTokenizer(), LIMITS)  # type: ignore[arg-type]


def test_body_becomes_one_sampling_params() -> None:
    p = parse({"prompt": "abc", "max_tokens": 8, "temperature": 1e-9, "top_k": 5, "top_p": 0.5, "seed": 3,
               "stop": "x", "ignore_eos": True, "stream": True, "priority": "background"})
    assert p.prompt_ids == [97, 98, 99] and p.stream and p.priority == "background"
    assert p.sampling == SamplingParams(max_tokens=8, temperature=0.0, top_k=5, top_p=0.5, seed=3, stop=("x",),
                                        ignore_eos=True)  # a tiny temperature is greedy
    assert parse({"prompt": "abc"}).sampling == SamplingParams(max_tokens=16, temperature=1.0)  # OpenAI's default


@pytest.mark.parametrize("body, param, word", [
    ({"prompt": "x", "top_k": -1}, "top_k", "top_k"),
    ({"prompt": "x", "seed": -1}, "seed", "seed"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "max_tokens": 33}, "max_tokens", "between 1 and 32"),
    ({"prompt": "x", "temperature": 3}, "temperature", "temperature"),
    ({"prompt": "x", "stop": [""]}, "stop", "stop"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "y" * 41}, "prompt", "at most 40"),
    ({"prompt": [300]}, "prompt", "token ids"),
])
def test_refusals_name_the_field(body: dict, param: str, word: str) -> None:
    with pytest.raises(InvalidRequest, match=word) as err:
        parse(body)
    assert err.value.param == param


@pytest.mark.parametrize("key, shown", [
    ("\u00b2", "'\u00b2'"),                    # superscript two: str.isdigit() says yes, int() raises
    ("\u0663", "'\u0663'"),                    # Arabic-Indic three: int() reads it as 3
    ("1" * 4301, "(4301 characters)"),         # over int()'s 4,300-digit limit
    ("00000000001", "'00000000001'"),          # 11 digits: past the bound, though it names token 1
    ("", "''"), ("-1", "'-1'"), (" 1", "' 1'"), ("256", "'256'"),
])
def test_a_logit_bias_key_that_is_no_ascii_token_id_is_a_400_naming_it(key: str, shown: str) -> None:
    with pytest.raises(BadRequest, match="ASCII digits") as err:
        parse({"prompt": "x", "logit_bias": {key: 1}})
    assert err.value.param == "logit_bias" and shown in str(err.value) and len(str(err.value)) < 200
    assert parse({"prompt": "x", "logit_bias": {"0255": 1}}).sampling.logit_bias == ((255, 1.0),)


def test_chat_prompt_errors_name_messages() -> None:
    with pytest.raises(InvalidRequest, match="at most 40") as err:
        parse({"messages": [{"role": "user", "content": "z" * 60}]}, "chat")
    assert err.value.param == "messages"
    with pytest.raises(BadRequest):
        parse({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "chat")
