"""The HTTP routes: OpenAI-compatible completions and chat completions (streamed as server-sent
events or not), models, health, readiness and Prometheus metrics, behind `agent.api.guard` (bearer
token, body-size limit). Handlers never touch the model: they parse (`agent.api.openai`), submit to
the engine loop and relay its events.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from fastapi import FastAPI, Request
from pydantic import BaseModel
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.api.guard import BodyTooLarge, GuardMiddleware
from agent.api.logprobs import chat_logprobs, completion_logprobs
from agent.api.openai import (ChatBody, CompletionBody, Limits, PromptTokenizer, completion_response, error_body,
                              parse_request, stream_chunk)
from agent.engine.loop import EngineLoop
from agent.engine.types import (Delta, EngineStopped, Finished, InvalidRequest, QueueFull, TokenLogprob,
                                next_request_id)
from agent.metrics import ServiceMetrics

log = logging.getLogger("orin_agent.api")


class ServiceTokenizer(PromptTokenizer, Protocol):
    """Parsing's needs and token texts (logprobs)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ApiState:
    engine: EngineLoop
    tokenizer: ServiceTokenizer
    model_name: str
    limits: Limits
    metrics: ServiceMetrics
    token: str | None = None
    max_body_bytes: int = 1 << 20
    chat_template: str | None = None
    eos_token: str = ""
    ready: Callable[[], tuple[bool, str]] = field(default=lambda: (True, "ready"))
    max_in_flight: int = 0  # HTTP requests answered at once; 0 = no limit
    host_names: tuple[str, ...] = ()  # Host header names accepted; () = any


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def body_schema(model: type[BaseModel]) -> dict[str, object]:
    """The request body's JSON schema for /openapi.json (the handlers read the raw body themselves)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    _BODY_DEFS.update(defs)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": _GENERATE_RESPONSES}


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERROR = {"description": "An OpenAI-style error", "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
# the generate endpoints answer JSON, or server-sent events when the body asks for "stream": true
_GENERATE_RESPONSES = {
    "200": {"description": "The completion (JSON), or its chunks as server-sent events",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {  # schemathesis checks each event as {data, event}
                            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}},
    "4XX": _ERROR, "5XX": _ERROR}


_BODY_DEFS: dict[str, object] = {}  # the body models' nested schemas, for /openapi.json's components


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(state: ApiState) -> FastAPI:
    # /openapi.json is behind the token like everything but /health (clients and schemathesis use it).
    app = FastAPI(title="orin-agent", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.api = state

    @app.exception_handler(InvalidRequest)
    async def _bad(_: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(BodyTooLarge)
    async def _large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return _error(413, f"the request body is over {state.max_body_bytes} bytes")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error", headers=dict(exc.headers or {}))  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")  # the traceback goes to the log, never to the client
        return _error(500, f"internal error ({type(exc).__name__}); see the service log", "server_error")

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, why = state.ready()
        return JSONResponse({"ready": ok, "status": why}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "orin-agent",
             "max_model_len": state.engine.max_seq}]})

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
    async def completions(request: Request) -> Response:
        return await _generate("completion", request)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat_completions(request: Request) -> Response:
        return await _generate("chat", request)

    async def _generate(kind: str, request: Request) -> Response:
        raw = await request.body()
        # Parsing tokenises: off the event loop, so a long prompt never stalls other streams or /health.
        p = await asyncio.to_thread(parse_request, kind, raw, state.tokenizer, state.limits,  # type: ignore[arg-type]
                                    state.chat_template, state.eos_token)
        if p.model is not None and p.model != state.model_name:
            return _error(404, f"model {p.model!r} is not served here; GET /v1/models lists {state.model_name!r}",
                          "not_found_error", "model", code="model_not_found")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[object] = asyncio.Queue()

        def sink(ev: object) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        rid = next_request_id("chatcmpl" if kind == "chat" else "cmpl")
        try:
            state.engine.submit(p.prompt_ids, p.sampling, sink, priority=p.priority, req_id=rid)
        except QueueFull as exc:
            return _error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after_s)},
                          code="rate_limit_exceeded")
        except EngineStopped as exc:
            return _error(503, str(exc), "server_error", headers={"Retry-After": "5"})
        model = state.model_name
        want_logprobs = p.sampling.logprobs is not None
        if p.stream:
            return StreamingResponse(_stream(rid, kind, model, q, p.include_usage, want_logprobs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts: list[str] = []
        lps: list[TokenLogprob] = []
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(q.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client went away: free its cache row now, not at max_tokens
                    get.cancel()
                    state.engine.cancel(rid)
                    return Response(status_code=499)
                ev = get.result()
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    lps.extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    if ev.reason == "error":
                        return _error(500, ev.message or "generation failed", "server_error")
                    if ev.reason in ("shutdown", "unavailable"):
                        return _error(503, ev.message, "server_error", headers={"Retry-After": "5"})
                    return JSONResponse(completion_response(rid, model, kind, "".join(parts), ev.reason, ev.usage,
                                                            _logprobs(kind, lps, 0)[0] if want_logprobs else None))
        except asyncio.CancelledError:
            state.engine.cancel(rid)
            raise
        finally:
            gone.cancel()

    async def _stream(rid: str, kind: str, model: str, q: asyncio.Queue[object],
                      include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
        created = int(time.time())
        done = False
        offset = 0  # completion characters so far: the next chunk's first text_offset
        try:
            if kind == "chat":
                yield stream_chunk(rid, model, kind, created, text="", first=True)
            while True:
                ev = await q.get()
                if isinstance(ev, Delta):
                    lp = None
                    if want_logprobs:
                        lp, offset = _logprobs(kind, ev.logprobs, offset)
                    yield stream_chunk(rid, model, kind, created, text=ev.text, logprobs=lp)
                elif isinstance(ev, Finished):
                    done = True
                    if ev.reason in ("error", "shutdown", "unavailable"):
                        yield f"data: {json.dumps(error_body(ev.message or 'generation failed', 'server_error'))}\n\n"
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

    def _logprobs(kind: str, entries: Sequence[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
        def text(token: int) -> str:
            return state.tokenizer.decode([token])

        if kind == "chat":
            return chat_logprobs(entries, text), offset
        return completion_logprobs(entries, text, offset)

    base_openapi = app.openapi

    def openapi() -> dict[str, object]:
        doc = base_openapi()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_BODY_DEFS)  # type: ignore[union-attr]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    return GuardMiddleware(app, state.token, state.max_body_bytes, state.metrics.on_http,
                           state.max_in_flight, state.host_names)  # type: ignore[return-value]
