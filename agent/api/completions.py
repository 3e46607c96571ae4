"""The two generate endpoints' handling (/v1/completions and /v1/chat/completions): parse the body off
the event loop, submit to the engine loop, then relay its events as one JSON answer or as server-sent
events. A client that goes away has its request cancelled, so its cache row is freed at once."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent.api.errors import error_response
from agent.api.logprobs import chat_logprobs, completion_logprobs
from agent.api.openai import completion_response, error_body, parse_request, stream_chunk
from agent.api.state import ApiState
from agent.engine.types import Delta, EngineStopped, Finished, QueueFull, TokenLogprob, next_request_id


async def generate(state: ApiState, kind: str, request: Request) -> Response:
    """Answer one generate request of `kind` ("completion" or "chat")."""
    raw = await request.body()
    # Parsing tokenises: off the event loop, so a long prompt never stalls other streams or /health.
    p = await asyncio.to_thread(parse_request, kind, raw, state.tokenizer, state.limits,  # type: ignore[arg-type]
                                state.chat_template, state.eos_token)
    if p.model is not None and p.model != state.model_name:
        return error_response(404, f"model {p.model!r} is not served here; GET /v1/models lists "
                              f"{state.model_name!r}", "not_found_error", "model", code="model_not_found")
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[object] = asyncio.Queue()

    def sink(ev: object) -> None:
        loop.call_soon_threadsafe(q.put_nowait, ev)

    rid = next_request_id("chatcmpl" if kind == "chat" else "cmpl")
    try:
        state.engine.submit(p.prompt_ids, p.sampling, sink, priority=p.priority, req_id=rid)
    except QueueFull as exc:
        return error_response(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after_s)},
                              code="rate_limit_exceeded")
    except EngineStopped as exc:
        return error_response(503, str(exc), "server_error", headers={"Retry-After": "5"})
    want_logprobs = p.sampling.logprobs is not None
    if p.stream:
        return StreamingResponse(_stream(state, rid, kind, q, p.include_usage, want_logprobs),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _answer(state, rid, kind, q, want_logprobs, request)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _answer(state: ApiState, rid: str, kind: str, q: asyncio.Queue[object], want_logprobs: bool,
                  request: Request) -> Response:
    """The whole completion as one JSON answer, once the engine has finished it."""
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
                    return error_response(500, ev.message or "generation failed", "server_error")
                if ev.reason in ("shutdown", "unavailable"):
                    return error_response(503, ev.message, "server_error", headers={"Retry-After": "5"})
                return JSONResponse(completion_response(rid, state.model_name, kind, "".join(parts), ev.reason,
                                                        ev.usage,
                                                        _logprobs(state, kind, lps, 0)[0] if want_logprobs else None))
    except asyncio.CancelledError:
        state.engine.cancel(rid)
        raise
    finally:
        gone.cancel()


async def _stream(state: ApiState, rid: str, kind: str, q: asyncio.Queue[object],
                  include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    """The completion as server-sent events: a chunk per delta, the finish, usage if asked, [DONE]."""
    model = state.model_name
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
                    lp, offset = _logprobs(state, kind, ev.logprobs, offset)
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


def _logprobs(state: ApiState, kind: str, entries: Sequence[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    def text(token: int) -> str:
        return state.tokenizer.decode([token])

    if kind == "chat":
        return chat_logprobs(entries, text), offset
    return completion_logprobs(entries, text, offset)
