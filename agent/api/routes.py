"""The HTTP app: OpenAI-compatible completions and chat completions (agent.api.completions), models,
health, readiness and Prometheus metrics, behind `agent.api.guard` (bearer token, body-size limit).
Handlers never touch the model: they parse (`agent.api.openai`), submit to the engine loop and relay
its events. Error answers: agent.api.errors; the /openapi.json additions: agent.api.schema; the state
the handlers share: agent.api.state.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from agent.api.completions import generate
from agent.api.errors import add_error_handlers
from agent.api.guard import GuardMiddleware
from agent.api.openai import ChatBody, CompletionBody
from agent.api.schema import add_body_components, body_schema
from agent.api.state import ApiState, ServiceTokenizer

__all__ = ["ApiState", "ServiceTokenizer", "create_app"]


def create_app(state: ApiState) -> FastAPI:
    """The service's ASGI app: the FastAPI routes inside the guard middleware."""
    # /openapi.json is behind the token like everything but /health (clients and schemathesis use it).
    app = FastAPI(title="orin-agent", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.api = state
    add_error_handlers(app)
    add_status_routes(app, state)
    add_generate_routes(app, state)
    add_body_components(app, (CompletionBody, ChatBody))
    return GuardMiddleware(app, state.token, state.max_body_bytes, state.metrics.on_http,
                           state.max_in_flight, state.host_names, state.body_timeout_s,
                           state.metrics.on_disconnect,
                           lambda: not state.engine.accepting)  # type: ignore[return-value]


def add_status_routes(app: FastAPI, state: ApiState) -> None:
    """/health (liveness), /ready, /metrics (Prometheus) and /v1/models."""

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


def add_generate_routes(app: FastAPI, state: ApiState) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
    async def completions(request: Request) -> Response:
        return await generate(state, "completion", request)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat_completions(request: Request) -> Response:
        return await generate(state, "chat", request)
