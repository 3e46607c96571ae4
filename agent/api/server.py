"""The HTTP server's connection handling: uvicorn's h11 protocol plus a header-read timeout, so a
connection that sends no request (or only part of its headers) is closed instead of held for ever.
uvicorn itself only times out idle keep-alive connections after a response (`timeout_keep_alive`);
a fresh connection that never sends a byte would otherwise stay open. The request limit is not
uvicorn's `limit_concurrency` (it counts open connections, idle ones included, and answers plain
text): `agent.api.guard` counts requests in flight and answers JSON 503 with Retry-After.

At shutdown no accepted request meets a closed socket (`DrainingServer`): the connections the kernel
has already accepted (its listen backlog) are taken in before the listening socket closes, and a
connection with no request in progress is kept `DRAIN_S` for one already on its way; the guard answers
each such request 503 with Retry-After (the service is stopping). uvicorn alone closes both.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol


DRAIN_S = 1.0  # at shutdown: how long a connection with no request yet is kept for one already sent

log = logging.getLogger("orin_agent.api")


class TimedH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers have not all arrived within
    `header_timeout_s` of the connection (or of the previous response), and that, at shutdown, keeps
    a connection with no request in progress `DRAIN_S` longer for one on its way (answered 503)."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None

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
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE and self._drain_timer is None:
            self._arm_header_timer()  # the next request on this connection gets the same bound

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's graceful stop: a request in progress ends, then the connection closes; with none in
        progress the connection stays `DRAIN_S` for a request already sent (uvicorn would close it now,
        cutting that request without an answer)."""
        if self.cycle is not None and not self.cycle.response_complete:
            super().shutdown()
            return
        self._cancel_header_timer()
        if self._drain_timer is None and not self.transport.is_closing():
            self._drain_timer = self.loop.call_later(DRAIN_S, self._drained)

    def _drained(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a request came: close after its answer
        else:
            super().shutdown()  # nothing (or half a request's headers) came: close it


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first takes in the connections the kernel already accepted (in
    the listen backlog), so that each is answered (503 from the guard) rather than reset."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        # A second descriptor of each listening socket keeps it open past asyncio's close, long enough
        # to accept what is queued; once it closes, new connections are refused.
        held = [socket.socket(fileno=os.dup(s.fileno())) for server in self.servers for s in server.sockets]
        for server in self.servers:
            server.close()
        taken = 0
        for listener in held:
            try:
                listener.setblocking(False)
                while True:
                    try:
                        conn, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    conn.setblocking(False)
                    await loop.connect_accepted_socket(self._protocol, conn)
                    taken += 1
            except OSError as exc:  # the listening socket is gone: nothing queued to take
                log.warning("at shutdown, the listen backlog could not be taken in: %s", exc)
            finally:
                listener.close()
        if taken:
            log.info("at shutdown: %d connection(s) from the listen backlog taken in to be answered", taken)
        await super().shutdown(sockets)

    def _protocol(self) -> asyncio.Protocol:
        """What uvicorn's startup makes per connection (uvicorn.Server.startup's create_protocol)."""
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,  # type: ignore[call-arg]
                                               app_state=self.lifespan.state)


def protocol_class(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


def server_config(app: ASGIApp, *, keep_alive_s: float, header_timeout_s: float, graceful_s: float) -> uvicorn.Config:
    """uvicorn's config for the service: no access log, no lifespan, our protocol, no connection cap."""
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                          http=protocol_class(header_timeout_s),  # type: ignore[arg-type]
                          timeout_keep_alive=max(1, int(round(keep_alive_s))),
                          timeout_graceful_shutdown=max(1, int(graceful_s)), limit_concurrency=None)
