"""The API's error answers: `error_response` (an OpenAI-style error body with its status) and the app's
exception handlers, which turn a refused request (400), a client gone (499, logged once), Starlette's HTTP
errors (404, 405 with its Allow) and anything unexpected (500, traceback to the log only) into one."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from agent.api.guard import CLIENT_CLOSED
from agent.api.openai import error_body
from agent.engine.types import InvalidRequest

log = logging.getLogger("orin_agent.api")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every exception a handler lets out, answered as an OpenAI-style error."""

    @app.exception_handler(InvalidRequest)
    async def _bad(_: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # The guard reads every body before a handler runs, so this is a handler that read the connection
        # itself: the client left, nothing to answer, one line (never a 500 and its tracebacks).
        log.info("%s %s: the client left before its request was answered", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                              "invalid_request_error", headers=dict(exc.headers or {}))  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")  # the traceback goes to the log, never to the client
        return error_response(500, f"internal error ({type(exc).__name__}); see the service log", "server_error")
