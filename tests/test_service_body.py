"""Request bodies at the guard (agent.api.guard): read whole within `body_timeout_s` of the headers
(else 408), counted toward the in-flight limit only once in, and a client that leaves mid-body is a
disconnect (one log line, status 499 and a disconnect counter in /metrics, never a 5xx)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from service_helpers import running_service

FLOOD = 160          # the issue's count: connections that each sent one body byte held every slot
BODY_TIMEOUT_S = 4.0


def _slow_body(port: int, length: int = 100, sent: bytes = b"{") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % length + sent)
    return s


def _status_line(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0 if want else float("nan")


def test_a_slow_body_flood_leaves_every_slot_to_other_clients_and_gets_408_at_the_deadline(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_service(tiny_checkpoint, tmp_path, body_timeout_s=BODY_TIMEOUT_S) as svc:
        assert svc.cfg.request_limit < FLOOD  # the flood alone would have held every slot
        t0 = time.monotonic()
        flood = [_slow_body(svc.port) for _ in range(FLOOD)]
        try:
            time.sleep(0.5)  # every flood request is in the app, waiting for its body
            codes: list[int] = []

            def client() -> None:
                r = httpx.post(f"{svc.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
                codes.append(r.status_code)

            threads = [threading.Thread(target=client) for _ in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            served_s = time.monotonic() - t0
            assert codes == [200] * 12, codes  # no 503 from the flood
            assert served_s < BODY_TIMEOUT_S, f"other clients were answered only after {served_s:.1f} s"
            lines = [_status_line(s) for s in flood]
            waited_s = time.monotonic() - t0
        finally:
            for s in flood:
                s.close()
        assert lines == [b"HTTP/1.1 408 Request Timeout"] * FLOOD, set(lines)
        assert BODY_TIMEOUT_S - 0.5 <= waited_s < BODY_TIMEOUT_S + 10
        text = httpx.get(f"{svc.url}/metrics").text
        assert _metric(text, "orin_agent_requests_total", endpoint="/v1/completions", status="408") == FLOOD
        assert _metric(text, "orin_agent_requests_total", endpoint="/v1/completions", status="503") == 0
        assert httpx.get(f"{svc.url}/health").status_code == 200


def test_a_client_leaving_mid_body_is_one_log_line_and_a_disconnect_not_a_500(
        tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="orin_agent")
    with running_service(tiny_checkpoint, tmp_path) as svc:
        s = _slow_body(svc.port, length=400, sent=b'{"prompt": "half')
        time.sleep(0.3)
        s.close()
        end = time.monotonic() + 5
        text = ""
        while time.monotonic() < end:
            text = httpx.get(f"{svc.url}/metrics").text
            if _metric(text, "orin_agent_client_disconnects_total", endpoint="/v1/completions", stage="body"):
                break
            time.sleep(0.05)
        assert _metric(text, "orin_agent_client_disconnects_total", endpoint="/v1/completions", stage="body") == 1
        assert _metric(text, "orin_agent_requests_total", endpoint="/v1/completions", status="499") == 1
        assert not any(f'status="5' in ln for ln in text.splitlines() if ln.startswith("orin_agent_requests_total"))
        r = httpx.post(f"{svc.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    left = [r for r in caplog.records if "left before its request body" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_body_over_the_limit_while_it_streams_is_413(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_service(tiny_checkpoint, tmp_path, max_body_bytes=2048) as svc:
        s = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
        try:  # chunked: no Content-Length to refuse up front
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b" " * 1024 + b"\r\n" + b"400\r\n"
                      + b" " * 1024 + b"\r\n" + b"10\r\n" + b" " * 16 + b"\r\n")
            assert _status_line(s) == b"HTTP/1.1 413 Request Entity Too Large"
        finally:
            s.close()
