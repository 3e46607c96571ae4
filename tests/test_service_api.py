"""The real service on a free localhost port (in a thread) against a twin: HTTP, streaming and not,
the official openai client, auth, limits, 429, batching identity, cancellation, phases, energy."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from service_helpers import ThrottleListener, running_service

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def svc(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    listener = ThrottleListener()
    with running_service(tiny_checkpoint, tmp_path_factory.mktemp("svc"), listener=listener,
                         token=TOKEN, max_batch=4, max_queue=2, max_body_bytes=4096) as s:
        yield s


@pytest.fixture()
def client(svc) -> Iterator[httpx.Client]:
    svc.listener.delay_s = 0.0
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def complete(c: httpx.Client, prompt: str, n: int = 16, **kw) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                         "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(c: httpx.Client, url: str, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with c.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        chunks.append(json.loads(ln[6:]))
    if url.endswith("chat/completions"):
        text = "".join(ch["delta"].get("content") or "" for c_ in chunks for ch in c_["choices"])
    else:
        text = "".join(ch["text"] for c_ in chunks for ch in c_["choices"])
    return text, chunks


def test_health_is_open_everything_else_needs_the_token(svc) -> None:
    with httpx.Client(base_url=svc.url, timeout=10) as anon:
        assert anon.get("/health").json() == {"status": "ok"}
        for path in ("/ready", "/metrics", "/v1/models"):
            r = anon.get(path)
            assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"]
        assert anon.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        r = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401


def test_models_ready_metrics(client: httpx.Client, svc) -> None:
    assert client.get("/ready").json()["ready"] is True
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == svc.cfg.model_dir.name
    complete(client, "def main():", 4)
    text = client.get("/metrics").text
    for name in ("orin_agent_requests_total", "orin_agent_time_to_first_token_seconds_bucket",
                 "orin_agent_inter_token_latency_seconds_bucket", "orin_agent_queue_depth",
                 'orin_agent_phase{phase="idle"}', 'orin_agent_clock_hertz{domain="gpu"}',
                 "orin_agent_zone_temperature_celsius", "orin_agent_board_power_watts",
                 "orin_agent_joules_per_token", "orin_agent_completion_tokens_total"):
        assert name in text, name


def test_completion_non_streaming_matches_streaming(client: httpx.Client) -> None:
    body = {"prompt": "import os\n", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    assert whole["choices"][0]["finish_reason"] == "length"
    u = whole["usage"]
    assert u["completion_tokens"] == 12 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + 12
    assert u["energy_joules"] is not None and u["energy_joules"] > 0  # the twin's rails
    text, chunks = stream_text(client, "/v1/completions", body)
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_streaming_with_usage_chunk(client: httpx.Client) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, chunks = stream_text(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["message"]["content"] == text


def test_official_openai_client(svc) -> None:
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{svc.url}/v1", api_key=TOKEN, max_retries=0)
    model = oc.models.list().data[0].id
    chat = oc.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                      max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens >= 1
    pieces = [ch.choices[0].delta.content or "" for ch in oc.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True)
        if ch.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    comp = oc.completions.create(model=model, prompt="def f(x):", max_tokens=5, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{svc.url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="not-this-one", prompt="x", max_tokens=2)


def test_limits_give_400_with_a_message(client: httpx.Client, svc) -> None:
    for body, word in (({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                       ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
                       ({"prompt": "x " * 400}, "prompt"),
                       ({"prompt": ""}, "empty"),
                       ({"prompt": "x", "temperature": -1}, "temperature"),
                       ({"prompt": "x", "n": 3}, "n"),
                       ({"messages": []}, "messages")):
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = client.post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        assert word in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 5000 + b'"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_batched_decode_gives_the_single_request_text(client: httpx.Client, svc) -> None:
    prompts = ["def add(a, b):", "import sys", "class Foo:\n    ", "héllo wörld"]
    alone = [complete(client, p, 20)["choices"][0]["text"] for p in prompts]
    got: dict[int, str] = {}
    svc.listener.delay_s = 0.002  # keep all four in flight together

    def one(i: int) -> None:
        with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            got[i] = complete(c, prompts[i], 20)["choices"][0]["text"]

    before = len(svc.listener.events)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == alone
    batches = [e.batch for e in svc.listener.events[before:] if e.kind == "decode"]
    assert max(batches) > 1  # decode really ran batched


def test_queue_full_gives_429_with_retry_after(client: httpx.Client, svc) -> None:
    svc.listener.delay_s = 0.05  # every step takes 50 ms: nothing finishes during the test
    body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
    streams = []
    try:
        for _ in range(svc.cfg.max_batch + svc.cfg.max_queue):  # fill every slot, then the queue
            cm = client.stream("POST", "/v1/completions", json=body)
            streams.append(cm)
            cm.__enter__()
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429
        assert r.headers["retry-after"].isdigit()
        assert "queue is full" in r.json()["error"]["message"]
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)  # closing the connections cancels the requests
    svc.listener.delay_s = 0.0
    deadline = time.monotonic() + 10
    while svc.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.engine.in_flight == 0
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_client_disconnect_cancels_and_frees_the_slot(client: httpx.Client, svc) -> None:
    svc.listener.delay_s = 0.02
    body = {"prompt": "def f():", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
        assert svc.engine.scheduler.num_running == 1
    deadline = time.monotonic() + 5
    while svc.engine.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.engine.scheduler.num_running == 0 and svc.engine.in_flight == 0
    assert sorted(svc.engine.scheduler.free_slots) == list(range(svc.cfg.max_batch))
    assert 'orin_agent_requests_finished_total{reason="cancelled"}' in client.get("/metrics").text


def test_phase_events_on_every_transition(client: httpx.Client, svc) -> None:
    before = len(svc.listener.events)
    complete(client, "for i in range(10):", 5)
    time.sleep(0.6)  # the loop announces idle once it finds nothing to do
    kinds = [e.kind for e in svc.listener.events[before:]]
    assert kinds[0] == "prefill" and kinds[-1] == "idle"
    assert kinds.count("decode") == 4  # 5 tokens: one from the prefill, four decode steps
    ev = next(e for e in svc.listener.events[before:] if e.kind == "prefill")
    assert ev.n_tokens > 0 and ev.batch == 1


def test_background_priority_accepted(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": "background"})
    assert r.status_code == 200
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": "urgent"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


def test_no_rails_means_null_energy(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_service(tiny_checkpoint, tmp_path, twin=False) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["energy_joules"] is None
