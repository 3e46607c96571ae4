"""The HTTP API: OpenAI-compatible completions and chat completions (streamed as server-sent events
or not), models, health, readiness and Prometheus metrics, behind a bearer token and a body-size
limit. Handlers never touch the model: they parse, submit to the engine and relay its events.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.engine import Delta, Engine, EngineStopped, Finished
from agent.generation import GenerationError, SamplingParams
from agent.metrics import ServiceMetrics
from agent.protocol import (BadRequest, Limits, completion_response, error_body, parse_request, stream_chunk)
from agent.scheduler import QueueFull, RequestRejected, next_request_id

log = logging.getLogger("orin_agent.api")

OPEN_PATHS = {"/health"}
KNOWN_PATHS = {"/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


@dataclass
class ApiState:
    engine: Engine
    tokenizer: Any
    model_name: str
    limits: Limits
    metrics: ServiceMetrics
    token: str | None = None
    max_body_bytes: int = 1 << 20
    chat_template: str | None = None
    eos_token: str = ""
    ready: Callable[[], tuple[bool, str]] = field(default=lambda: (True, "ready"))


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Bearer token on every path but /health, the body-size limit, and per-endpoint status counts."""

    def __init__(self, app: ASGIApp, state: ApiState) -> None:
        self.app, self.state = app, state

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

        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            st = self.state
            if st.token and path not in OPEN_PATHS:
                given = headers.get("authorization", "")
                scheme, _, value = given.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), st.token.encode()):
                    await _json(counting_send, 401, error_body("missing or wrong bearer token (Authorization: "
                                                               "Bearer <token>)", "authentication_error"),
                                {"www-authenticate": "Bearer"})
                    return
            length = headers.get("content-length")
            if length is not None:
                if not length.isdigit():
                    await _json(counting_send, 400, error_body("Content-Length is not a number"))
                    return
                if int(length) > st.max_body_bytes:
                    await _json(counting_send, 413, error_body(f"the request body is over {st.max_body_bytes} bytes"))
                    return
            seen = 0

            async def limited_receive() -> Message:
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > st.max_body_bytes:
                        raise BodyTooLarge()
                return message

            await self.app(scope, limited_receive, counting_send)
        finally:
            self.state.metrics.on_http(endpoint, status["code"])


async def _json(send: Send, status: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param), status_code=status, headers=headers)


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="orin-agent", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = state

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), param=exc.param)

    @app.exception_handler(BodyTooLarge)
    async def _large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return _error(413, f"the request body is over {state.max_body_bytes} bytes")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")  # the traceback goes to the log, never to the client
        return _error(500, f"internal error ({type(exc).__name__}); see the service log", "server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, why = state.ready()
        return JSONResponse({"ready": ok, "status": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "orin-agent",
             "max_model_len": state.engine.max_seq}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate("chat", request)

    async def _generate(kind: str, request: Request) -> Response:
        raw = await request.body()
        p = parse_request(kind, raw, state.tokenizer, state.limits, state.chat_template, state.eos_token)  # type: ignore[arg-type]
        if p.model and p.model != state.model_name:
            return _error(404, f"model {p.model!r} is not served here; GET /v1/models lists {state.model_name!r}",
                          "not_found_error", "model")
        try:
            params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                    top_p=p.top_p, repetition_penalty=p.repetition_penalty, seed=p.seed,
                                    stop=p.stop, ignore_eos=p.ignore_eos)
        except GenerationError as exc:
            raise BadRequest(str(exc)) from None
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[object] = asyncio.Queue()

        def sink(ev: object) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        rid = next_request_id("chatcmpl" if kind == "chat" else "cmpl")
        try:
            state.engine.submit(p.prompt_ids, params, sink, priority=p.priority, req_id=rid)
        except QueueFull as exc:
            return _error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after_s)})
        except RequestRejected as exc:
            raise BadRequest(str(exc)) from None
        except EngineStopped as exc:
            return _error(503, str(exc), "server_error", headers={"Retry-After": "5"})
        model = state.model_name
        if p.stream:
            return StreamingResponse(_stream(rid, kind, model, q, p.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts: list[str] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        state.engine.cancel(rid)
                        return Response(status_code=499)
                    continue
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                elif isinstance(ev, Finished):
                    if ev.reason == "error":
                        return _error(500, ev.message or "generation failed", "server_error")
                    return JSONResponse(completion_response(rid, model, kind, "".join(parts), ev.reason, ev.usage))
        except asyncio.CancelledError:
            state.engine.cancel(rid)
            raise

    async def _stream(rid: str, kind: str, model: str, q: asyncio.Queue[object],
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        done = False
        try:
            if kind == "chat":
                yield stream_chunk(rid, model, kind, created, text="", first=True)
            while True:
                ev = await q.get()
                if isinstance(ev, Delta):
                    yield stream_chunk(rid, model, kind, created, text=ev.text)
                elif isinstance(ev, Finished):
                    done = True
                    if ev.reason == "error":
                        yield f"data: {json.dumps(error_body(ev.message, 'server_error'))}\n\n"
                    else:
                        reason = ev.reason if ev.reason in ("stop", "length") else "stop"
                        yield stream_chunk(rid, model, kind, created, reason=reason,
                                           usage=None if include_usage else ev.usage)
                        if include_usage:
                            yield stream_chunk(rid, model, kind, created, usage=ev.usage, no_choices=True)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away (or the server is stopping): free the cache slot
                state.engine.cancel(rid)

    return GuardMiddleware(app, state)  # type: ignore[return-value]
