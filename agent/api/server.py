"""The HTTP server's connection handling: uvicorn's h11 protocol plus a header-read timeout, so a
connection that sends no request (or only part of its headers) is closed instead of held for ever.
uvicorn itself only times out idle keep-alive connections after a response (`timeout_keep_alive`);
a fresh connection that never sends a byte would otherwise stay open. The request limit is not
uvicorn's `limit_concurrency` (it counts open connections, idle ones included, and answers plain
text): `agent.api.guard` counts requests in flight and answers JSON 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers have not all arrived within
    `header_timeout_s` of the connection (or of the previous response)."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in: the handler's time now
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request on this connection gets the same bound

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def protocol_class(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


def server_config(app: ASGIApp, *, keep_alive_s: float, header_timeout_s: float, graceful_s: float) -> uvicorn.Config:
    """uvicorn's config for the service: no access log, no lifespan, our protocol, no connection cap."""
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                          http=protocol_class(header_timeout_s),  # type: ignore[arg-type]
                          timeout_keep_alive=max(1, int(round(keep_alive_s))),
                          timeout_graceful_shutdown=max(1, int(graceful_s)), limit_concurrency=None)
