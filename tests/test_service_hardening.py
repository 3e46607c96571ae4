"""The service under a hostile but fair client, on 127.0.0.1 against a twin: idle and half-sent
connections time out and never take /health down; the request limit answers JSON 503 with
Retry-After; one instance per board root; non-streaming requests are cancelled when their client
goes; oversized prompts are refused before tokenising, and tokenising never blocks the event loop;
lone surrogates and huge integers are 400s naming the field; the end of the shutdown grace ends
every request with a final 503 / SSE error event; twin files are never seen half-written."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from service_helpers import ThrottleListener, make_twin, running_service

TOKEN = "s3"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def svc(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    listener = ThrottleListener()
    with running_service(tiny_checkpoint, tmp_path_factory.mktemp("hard"), listener=listener, token=TOKEN,
                         header_timeout_s=1.0, keep_alive_s=1.0, max_in_flight=6) as s:
        yield s


@pytest.fixture()
def client(svc) -> Iterator[httpx.Client]:
    svc.listener.delay_s = 0.0
    with httpx.Client(base_url=svc.url, timeout=30, headers=AUTH) as c:
        yield c


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    """The server closes ``s`` within ``within_s`` (the rest of a response still in flight is read
    and ignored: a body may arrive in a packet after its headers)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(4096) == b"":
                return True
        return False
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_half_sent_connections_time_out_and_health_stays_up(svc, client: httpx.Client) -> None:
    host, port = "127.0.0.1", svc.port
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(200)]
    half = socket.create_connection((host, port), timeout=5)
    half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    try:
        t0 = time.monotonic()
        r = httpx.get(f"{svc.url}/health", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        # header_timeout_s is 1 s here: every one of them is closed by the server soon after
        assert _closed_by_server(half, 4.0), "a connection with half its headers was held open"
        closed = sum(_closed_by_server(s, 4.0) for s in idle[:20])
        assert closed == 20, f"only {closed}/20 idle connections were closed by the server"
    finally:
        for s in idle + [half]:
            s.close()


def test_keep_alive_connection_is_closed_after_its_timeout(svc) -> None:
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200" in s.recv(4096).split(b"\r\n", 1)[0]
        assert _closed_by_server(s, 4.0)
    finally:
        s.close()


def test_request_limit_is_json_503_with_retry_after_and_health_is_exempt(svc, client: httpx.Client) -> None:
    svc.listener.delay_s = 0.05
    body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.post(f"{svc.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code))
        for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while svc.engine.in_flight < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["type"] == "server_error"
    assert client.get("/health").status_code == 200
    for t in threads:
        t.join(60)
    assert results == [200] * 6


def test_lone_surrogate_and_huge_integers_are_400_naming_the_field(client: httpx.Client) -> None:
    for raw, param in ((b'{"prompt":"\\ud800abc","max_tokens":2}', "prompt"),
                       (b'{"messages":[{"role":"user","content":"a\\udfff"}]}', "messages.0.content"),
                       (b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}", "max_tokens"),
                       (b'{"prompt":[' + b"1" * 100 + b"]}", "prompt")):
        url = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = client.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw[:40], r.status_code, r.text[:200])
        assert r.json()["error"]["param"].startswith(param), r.text


def test_oversized_prompt_is_refused_before_tokenising(svc, client: httpx.Client) -> None:
    api = svc.app.app.state.api
    calls = []
    real = api.tokenizer

    class Counting:
        vocab_size = real.vocab_size

        def encode(self, text: str) -> list[int]:
            calls.append(len(text))
            return real.encode(text)

    api.tokenizer = Counting()
    try:
        r = client.post("/v1/completions", json={"prompt": "word " * 180_000, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert calls == [], "a ~1 MB prompt was tokenised before it was refused"
    finally:
        api.tokenizer = real


def test_tokenising_does_not_block_the_event_loop(svc, client: httpx.Client) -> None:
    # The tokenizer holds until /health has answered (or 10 s pass): were encode() run on the event
    # loop, /health could not answer while it holds and would time out. No wall-clock threshold, so a
    # loaded CI machine cannot make it fail.
    api = svc.app.app.state.api
    real = api.tokenizer
    started, health_answered = threading.Event(), threading.Event()
    held_until_health = []

    class Held:
        vocab_size = real.vocab_size

        def encode(self, text: str) -> list[int]:
            started.set()
            held_until_health.append(health_answered.wait(10))  # a tokenizer busy with a long prompt
            return real.encode(text)

    api.tokenizer = Held()
    try:
        t = threading.Thread(target=lambda: client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
        t.start()
        assert started.wait(10), "the completion never reached the tokenizer"
        try:
            status = httpx.get(f"{svc.url}/health", timeout=5).status_code
        except httpx.TimeoutException:
            status = None
        health_answered.set()
        t.join(30)
        assert status == 200, "/health did not answer while a tokenisation was in progress"
        assert held_until_health == [True], "the tokenisation ended before /health answered"
    finally:
        health_answered.set()
        api.tokenizer = real


def test_non_streaming_requests_are_cancelled_when_the_client_goes(svc, client: httpx.Client) -> None:
    svc.listener.delay_s = 0.08  # 64 tokens would take > 5 s
    body = {"prompt": "def f():", "max_tokens": 64, "ignore_eos": True}

    def go() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{svc.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(5, read=0.4))

    threads = [threading.Thread(target=go) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    while svc.engine.in_flight and time.monotonic() - t0 < 2.5:
        time.sleep(0.02)
    assert svc.engine.in_flight == 0, f"{svc.engine.in_flight} request(s) kept decoding after their clients left"
    svc.listener.delay_s = 0.0
    time.sleep(0.6)  # the engine loop publishes the queue gauges on its next pass
    assert "orin_agent_running_requests 0.0" in client.get("/metrics").text


def test_two_instances_on_one_root_the_second_is_refused_naming_the_first(tiny_checkpoint: Path,
                                                                         tmp_path: Path) -> None:
    import os

    from agent.config import ServiceConfig
    from agent.service import Service
    from power.hw.rootlock import BoardBusy

    with running_service(tiny_checkpoint, tmp_path, power_control=False) as first:
        cfg = ServiceConfig(**{**first.cfg.__dict__, "run_dir": str(tmp_path / "run2")})
        second = Service(cfg)
        with pytest.raises(BoardBusy, match=f"pid {os.getpid()} \\(orin-agent serve\\)"):
            second.load()
        assert not (tmp_path / "run2").exists()  # refused before it made (or read) its run dir


def test_the_end_of_the_grace_ends_streams_with_an_error_event_and_others_with_503(
        tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    listener = ThrottleListener()
    caplog.set_level(logging.INFO)
    with running_service(tiny_checkpoint, tmp_path, listener=listener, shutdown_grace_s=1.0,
                         max_output_tokens=200) as s:
        listener.delay_s = 0.05  # 200 tokens: ~10 s, far past the grace
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
        lines: list[str] = []
        plain: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                lines.extend(ln for ln in r.iter_lines() if ln)

        def non_stream() -> None:
            plain.append(httpx.post(f"{s.url}/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
        for t in threads:
            t.start()
        while s.engine.in_flight < 2:
            time.sleep(0.02)
        time.sleep(0.3)
        s.stop_thread()
        for t in threads:
            t.join(15)
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_error"
    r = plain[0]
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["message"], r.text
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]


def test_twin_files_are_never_seen_empty_while_written(tmp_path: Path) -> None:
    from power.hw.journal import BoardIO

    path = tmp_path / "max_freq"
    path.write_text("1300500000\n")
    io, stop, seen = BoardIO(), threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            seen.append(path.read_bytes())

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(3000):
            io.write(str(path), b"306000000\n" if i % 2 else b"1300500000\n")
    finally:
        stop.set()
        t.join()
    assert seen and b"" not in seen, f"{seen.count(b'')} of {len(seen)} reads saw an empty file"
    assert list(tmp_path.iterdir()) == [path]


def test_power_restore_without_root_uses_the_journals_root(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent.cli import app
    from power.hw.journal import Journal

    root = make_twin(tmp_path / "root")
    f = next(p for p in root.rglob("max_freq") if p.is_file())
    original = f.read_bytes()
    j = Journal(tmp_path / "run", root)
    j.record("/" + str(f.relative_to(root)), original)
    f.write_text("1\n")
    j.close()
    r = CliRunner().invoke(app, ["power", "restore", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert f.read_bytes() == original and "restored 1 file" in r.output
