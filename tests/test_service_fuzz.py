"""Fuzzed requests against the real service: malformed JSON, wrong types, huge values, unknown fields,
invalid UTF-8, negative limits. Every answer is 2xx or 4xx with an error message; never 5xx, never
a traceback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service_helpers import running_service

URLS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_service(tiny_checkpoint, tmp_path_factory.mktemp("fuzz"), twin=False, max_queue=64,
                         max_output_tokens=8, default_max_tokens=2, max_body_bytes=8192) as s:
        yield s.url


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    assert "Traceback" not in r.text and 'File "' not in r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ("prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "n",
          "seed", "priority", "repetition_penalty", "model", "stream_options", "max_completion_tokens",
          "frequency_penalty", "ignore_eos")
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=6)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(url=st.sampled_from(URLS), body=bodies)
def test_fuzzed_json_fields(base: str, url: str, body: dict) -> None:
    # "stream" true with a valid body is fine too; cap the work so the fuzzing stays fast
    with httpx.Client(base_url=base, timeout=30) as c:
        r = c.post(url, content=json.dumps(body, allow_nan=False).encode(),
                   headers={"content-type": "application/json"})
        check(r)


@SETTINGS
@given(url=st.sampled_from(URLS), raw=st.binary(max_size=200))
def test_fuzzed_raw_bytes(base: str, url: str, raw: bytes) -> None:
    with httpx.Client(base_url=base, timeout=30) as c:
        check(c.post(url, content=raw, headers={"content-type": "application/json"}))


@SETTINGS
@given(prompt=st.text(max_size=40), max_tokens=st.integers(min_value=-10**20, max_value=10**20),
       temperature=st.floats(allow_nan=True, allow_infinity=True), extra=st.text(max_size=10))
def test_fuzzed_valid_shape(base: str, prompt: str, max_tokens: int, temperature: float, extra: str) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, extra or "x": 1})
    with httpx.Client(base_url=base, timeout=30) as c:
        check(c.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"}))


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[]", b"null", b'"prompt"', b'{"prompt": "\xff\xfe"}', b'{"prompt": "ok"' + b"}" * 3,
    b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": [1, 2, 99999999]}', b'{"prompt": [-5]}', b'{"prompt": ["a", "b"]}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}', b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"prompt": "x", "stop": ["", "a"]}', b'{"prompt": "x", "seed": -1}', b'{"prompt": "x" "y"}',
], ids=lambda raw: raw[:24].decode("ascii", "replace"))
def test_known_bad_bodies(base: str, raw: bytes) -> None:
    with httpx.Client(base_url=base, timeout=30) as c:
        for url in URLS:
            r = c.post(url, content=raw, headers={"content-type": "application/json"})
            check(r)
            assert r.status_code == 400, (url, raw[:60], r.text)


def test_oversized_and_odd_requests(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30) as c:
        check(r := c.post("/v1/completions", content=b"x" * 10_000))
        assert r.status_code == 413
        check(r := c.post("/v1/completions", content=iter([b"{" * 5000, b"x" * 5000]),  # chunked, no length
                          headers={"content-type": "application/json"}))
        assert r.status_code == 413
        check(r := c.get("/v1/completions"))
        assert r.status_code == 405
        check(r := c.get("/nope"))
        assert r.status_code == 404
