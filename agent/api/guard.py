"""The HTTP guard in front of every route: the limit on requests in flight (JSON 503 with
Retry-After; /health and /ready never count), the Host header (against the configured names, so a
web page that rebinds its DNS name to 127.0.0.1 is refused), the bearer token (on every path but
/health), `Content-Type: application/json` on the JSON endpoints, the request-body size limit (by Content-Length and while the body streams in), and the per-endpoint
status counts for /metrics. Plain ASGI middleware, so it also guards what FastAPI would 404.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.api.openai import error_body

OPEN_PATHS = {"/health"}
JSON_PATHS = {"/v1/completions", "/v1/chat/completions"}
UNCOUNTED_PATHS = {"/health", "/ready"}  # cheap probes: answered even when the request limit is reached
BUSY_RETRY_AFTER_S = 1
KNOWN_PATHS = {"/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
               "/openapi.json"}


class BodyTooLarge(Exception):
    """The body grew past the limit while it streamed in (the app answers 413)."""


class GuardMiddleware:
    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int,
                 on_http: Callable[[str, int], None], max_in_flight: int = 0,
                 host_names: tuple[str, ...] = ()) -> None:
        self.app, self.token, self.max_body_bytes, self.on_http = app, token, max_body_bytes, on_http
        self.max_in_flight = max_in_flight  # 0: no limit
        self.in_flight = 0  # requests being answered (the event loop's thread only)
        self.host_names = frozenset(host_names)  # empty: any Host

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

        counted = path not in UNCOUNTED_PATHS
        if counted:
            self.in_flight += 1
        try:
            if counted and self.max_in_flight and self.in_flight > self.max_in_flight:
                await _json(counting_send, 503, error_body(f"the service is answering {self.max_in_flight} "
                                                           "requests; retry shortly", "server_error"),
                            {"retry-after": str(BUSY_RETRY_AFTER_S)})
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if self.host_names and path not in OPEN_PATHS and "host" in headers \
                    and host_name(headers["host"]) not in self.host_names:
                await _json(counting_send, 421, error_body(f"Host {headers['host']!r} is not a name this service "
                                                           "answers to (server.allowed_hosts)", "invalid_request_error",
                                                           None, "host_not_allowed"))
                return
            if self.token and path not in OPEN_PATHS:
                given = headers.get("authorization", "")
                scheme, _, value = given.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
                    await _json(counting_send, 401, error_body("missing or wrong bearer token (Authorization: "
                                                               "Bearer <token>)", "authentication_error",
                                                               None, "invalid_api_key"),
                                {"www-authenticate": "Bearer"})
                    return
            length = headers.get("content-length")
            if length is not None:
                if not length.isdigit():
                    await _json(counting_send, 400, error_body("Content-Length is not a number"))
                    return
                if int(length) > self.max_body_bytes:
                    await _json(counting_send, 413, error_body(f"the request body is over {self.max_body_bytes} bytes"))
                    return
            if scope.get("method") == "POST" and path in JSON_PATHS:
                media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
                if media != "application/json":
                    await _json(counting_send, 415, error_body(
                        f"Content-Type must be application/json, got {media or 'none'!r}", "invalid_request_error",
                        None, "unsupported_media_type"))
                    return
            seen = 0

            async def limited_receive() -> Message:
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > self.max_body_bytes:
                        raise BodyTooLarge()
                return message

            await self.app(scope, limited_receive, counting_send)
        finally:
            if counted:
                self.in_flight -= 1
            self.on_http(endpoint, status["code"])


def host_name(value: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


async def _json(send: Send, status: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
