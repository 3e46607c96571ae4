"""The HTTP guard in front of every route: the Host header (against the configured names, so a web
page that rebinds its DNS name to 127.0.0.1 is refused), the bearer token (on every path but /health),
`Content-Type: application/json` on the JSON endpoints, the request body read whole before the app
sees it (its size limit by Content-Length and while it streams in; its deadline, `body_timeout_s`
from the headers: a 408), the limit on requests in flight (JSON 503 with Retry-After; /health and
/ready never count; a request counts only once its body is in, so slow senders hold no slot), and the
per-endpoint status counts for /metrics, where a client that left before its answer is a 499 and a
disconnect of its own, never a 5xx. Plain ASGI middleware, so it also guards what FastAPI would 404.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.api.openai import error_body

OPEN_PATHS = {"/health"}
JSON_PATHS = {"/v1/completions", "/v1/chat/completions"}
UNCOUNTED_PATHS = {"/health", "/ready"}  # cheap probes: answered even when the request limit is reached
BUSY_RETRY_AFTER_S = 1
STOPPING_RETRY_AFTER_S = 5  # what completions' EngineStopped answer says too: a restart takes seconds
BODY_TIMEOUT_S = 30.0  # server.body_timeout_s: from the headers to the body's last byte
CLIENT_CLOSED = 499    # the status counted for a client that left before its answer (nginx's "client closed request")

KNOWN_PATHS = {"/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
               "/openapi.json"}

log = logging.getLogger("orin_agent.api")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int,
                 on_http: Callable[[str, int], None], max_in_flight: int = 0,
                 host_names: tuple[str, ...] = (), body_timeout_s: float = BODY_TIMEOUT_S,
                 on_disconnect: Callable[[str, str], None] | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.app, self.token, self.max_body_bytes, self.on_http = app, token, max_body_bytes, on_http
        self.max_in_flight = max_in_flight  # 0: no limit
        self.in_flight = 0  # requests whose body is in, being answered (the event loop's thread only)
        self.host_names = frozenset(host_names)  # empty: any Host
        self.body_timeout_s = body_timeout_s
        self.on_disconnect = on_disconnect or (lambda endpoint, stage: None)
        self.stopping = stopping  # the service began to stop: every new request gets 503 + Retry-After

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_PATHS else "other"
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        counted = False
        try:
            refused = self._refusal(scope, path)
            if refused is not None:
                await _json(counting_send, *refused)
                return
            # The body first, within its deadline: a request counts toward the limit only once it is in,
            # so slow senders cannot hold the slots (they get 408 at the deadline instead).
            body = await self._read_body(scope, receive, endpoint, counting_send)
            if isinstance(body, int):  # answered (408, 413), or the client left (counted as 499)
                status["code"] = body
                return
            if self.stopping() and path not in UNCOUNTED_PATHS:  # /health, /ready say so themselves
                await _json(counting_send, 503, error_body("the service is stopping; retry shortly (another "
                                                           "instance, or this one once restarted)", "server_error"),
                            {"retry-after": str(STOPPING_RETRY_AFTER_S), "connection": "close"})
                return
            counted = path not in UNCOUNTED_PATHS
            if counted:
                self.in_flight += 1
                if self.max_in_flight and self.in_flight > self.max_in_flight:
                    await _json(counting_send, 503, error_body(f"the service is answering {self.max_in_flight} "
                                                               "requests; retry shortly", "server_error"),
                                {"retry-after": str(BUSY_RETRY_AFTER_S)})
                    return
            await self.app(scope, _replay(body, receive), counting_send)
            if status["code"] == CLIENT_CLOSED:  # the handler saw its client leave (agent.api.completions)
                self.on_disconnect(endpoint, "answer")
        finally:
            if counted:
                self.in_flight -= 1
            self.on_http(endpoint, status["code"])

    def _refusal(self, scope: Scope, path: str) -> tuple[int, dict[str, Any], dict[str, str] | None] | None:
        """What the headers alone refuse (Host, token, Content-Length, Content-Type), or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.host_names and path not in OPEN_PATHS and "host" in headers \
                and host_name(headers["host"]) not in self.host_names:
            return 421, error_body(f"Host {headers['host']!r} is not a name this service answers to "
                                   "(server.allowed_hosts)", "invalid_request_error", None, "host_not_allowed"), None
        if self.token and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
                return 401, error_body("missing or wrong bearer token (Authorization: Bearer <token>)",
                                       "authentication_error", None, "invalid_api_key"), {"www-authenticate": "Bearer"}
        length = headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                return 400, error_body("Content-Length is not a number"), None
            if int(length) > self.max_body_bytes:
                return 413, error_body(f"the request body is over {self.max_body_bytes} bytes"), None
        if scope.get("method") == "POST" and path in JSON_PATHS:
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return 415, error_body(f"Content-Type must be application/json, got {media or 'none'!r}",
                                       "invalid_request_error", None, "unsupported_media_type"), None
        return None

    async def _read_body(self, scope: Scope, receive: Receive, endpoint: str, send: Send) -> bytes | int:
        """The whole body within ``body_timeout_s`` of the headers, or the status once answered (408,
        413), or CLIENT_CLOSED when the client left (a disconnect: logged once, counted apart from errors)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        parts: list[bytes] = []
        seen = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.info("%s %s: the request body was not in after %g s (%d bytes so far): 408",
                         scope.get("method"), scope.get("path"), self.body_timeout_s, seen)
                await _json(send, 408, error_body(f"the request body did not arrive within {self.body_timeout_s:g} s "
                                                  "(server.body_timeout_s)", "invalid_request_error", None,
                                                  "request_timeout"), {"connection": "close"})
                return 408
            if message["type"] == "http.disconnect":
                log.info("%s %s: the client left before its request body was in (%d bytes): not answered",
                         scope.get("method"), scope.get("path"), seen)
                self.on_disconnect(endpoint, "body")
                return CLIENT_CLOSED
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                await _json(send, 413, error_body(f"the request body is over {self.max_body_bytes} bytes"),
                            {"connection": "close"})
                return 413
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def host_name(value: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the body read already, once, then the connection's own (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()
    return replay


async def _json(send: Send, status: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
