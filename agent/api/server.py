"""The HTTP server's connection handling: uvicorn's h11 protocol plus a header-read timeout, so a
connection that sends no request (or only part of its headers) is closed instead of held for ever.
uvicorn itself only times out idle keep-alive connections after a response (`timeout_keep_alive`);
a fresh connection that never sends a byte would otherwise stay open. The request limit is not
uvicorn's `limit_concurrency` (it counts open connections, idle ones included, and answers plain
text): `agent.api.guard` counts requests in flight and answers JSON 503 with Retry-After.

At shutdown no accepted request meets a closed socket (`DrainingServer`): first the listening socket
stops answering new handshakes (`refuse_new_connections`, Linux), then the connections the kernel has
already accepted (its listen backlog, and handshakes under way for `HANDSHAKE_S`) are taken in, and
only then does the listening socket close; a connection with no request in progress is kept `DRAIN_S`
for one already on its way; the guard answers each such request 503 with Retry-After (the service is
stopping). uvicorn alone closes both. Closing a listening socket resets every connection still in its
queue, which its client sees as a reset after its request was sent: without the first step, one whose
handshake completed between the last accept and the close was cut (a rare 'cut' in the chaos test).
A client whose handshake is refused retries its SYN (1 s) and then meets the closed port: refused.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import sys
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("orin_agent.api")

DRAIN_S = 1.0  # at shutdown: how long a connection with no request yet is kept for one already sent
HANDSHAKE_S = 0.25  # at shutdown, new SYNs dropped: how long a handshake under way gets to complete (a round trip)

# A classic BPF socket filter that drops a segment with SYN set and ACK clear (a new connection's first
# segment) and keeps every other. On a listening TCP socket the kernel runs it on each segment, from the
# TCP header on (tcp_filter() in net/ipv4/tcp_ipv4.c, tcp_v6_rcv likewise), so a handshake under way
# still completes (its last ACK passes) and a new one gets no SYN-ACK. Accepted connections inherit
# the filter (sk_clone_lock); they never get a bare SYN. Opcodes: include/uapi/linux/bpf_common.h,
# filter.h (BPF_LD|BPF_B|BPF_ABS 0x30, BPF_ALU|BPF_AND|BPF_K 0x54, BPF_JMP|BPF_JEQ|BPF_K 0x15,
# BPF_RET|BPF_K 0x06).
_DROP_NEW_SYN = ((0x30, 0, 0, 13),          # A = the TCP flags byte
                 (0x54, 0, 0, 0x12),        # A &= SYN | ACK
                 (0x15, 0, 1, 0x02),        # A == SYN (a new handshake): drop; else keep
                 (0x06, 0, 0, 0),           # drop
                 (0x06, 0, 0, 0xFFFFFFFF))  # keep the whole segment
SO_ATTACH_FILTER = 26  # include/uapi/asm-generic/socket.h (x86, arm64 and the other asm-generic ABIs)


class _SockFilter(ctypes.Structure):  # struct sock_filter (include/uapi/linux/filter.h)
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def refuse_new_connections(sock: socket.socket) -> bool:
    """Make the listening socket `sock` drop new connections' SYNs (Linux); a handshake already under
    way still completes into the listen queue. False where that cannot be done (another OS): new
    connections then keep queueing until the close, which resets them."""
    if not sys.platform.startswith("linux"):
        return False
    prog = (_SockFilter * len(_DROP_NEW_SYN))(*(_SockFilter(*ins) for ins in _DROP_NEW_SYN))
    fprog = _SockFprog(len(_DROP_NEW_SYN), ctypes.cast(prog, ctypes.POINTER(_SockFilter)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))  # the kernel copies `prog` now
    except OSError as exc:
        log.warning("at shutdown, new connections could not be refused before the listener closes: %s", exc)
        return False
    return True


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
    """uvicorn's server, whose shutdown first stops new handshakes on the listening socket, then takes in
    the connections the kernel already accepted (its listen backlog), so that each is answered (503
    from the guard) rather than reset by the listener's close."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # A second descriptor of each listening socket keeps it open past asyncio's close, long enough
        # to accept what is queued; once it closes, new connections are refused.
        held = [socket.socket(fileno=os.dup(s.fileno())) for server in self.servers for s in server.sockets]
        refusing = [refuse_new_connections(listener) for listener in held]
        for server in self.servers:
            server.close()
        try:
            # New SYNs dropped, what can still join the queue is a handshake under way: HANDSHAKE_S for it.
            # Without the filter waiting helps nothing (new ones keep coming): the close may reset one.
            taken = await self._take_backlog(held, HANDSHAKE_S if held and all(refusing) else 0.0)
        finally:
            for listener in held:
                listener.close()
        if taken:
            log.info("at shutdown: %d connection(s) from the listen backlog taken in to be answered", taken)
        await super().shutdown(sockets)

    async def _take_backlog(self, held: list[socket.socket], settle_s: float) -> int:
        """Accept what is queued on each listening socket in `held`, and what arrives in the next
        `settle_s` (handshakes under way when new SYNs began to be dropped), each handed to our protocol;
        returns how many."""
        loop = asyncio.get_running_loop()
        end = loop.time() + settle_s
        live, taken = list(held), 0
        while True:
            for listener in list(live):
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
                    live.remove(listener)
            if not live or loop.time() >= end:
                return taken
            await asyncio.sleep(0.01)

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
