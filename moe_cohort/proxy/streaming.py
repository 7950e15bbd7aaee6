"""Server-sent events through the proxy: keep-alives while queued, then the backend's bytes as they come.

A streaming request waits for its turn up to `keepalive_s` before answering, watching its client
meanwhile: one that leaves is never sent (or its stream, opening, is closed). Admitted by then
(the usual case), it opens the backend stream first, so a backend error keeps its own status
code; otherwise it answers 200 at once and sends SSE comments (`: queued`) until admitted, and a
later error arrives as an SSE `data: {"error": ...}` event, as vLLM itself reports errors mid-stream.
Whatever happens (finish, error, client disconnect) `close()` runs once: it closes the backend
connection, which makes vLLM abort the request, and frees its slot (send/lifecycle.py). With several
replicas the stream opens on its slot's replica; one that is down before any byte of the answer
came back passes the request to another (send.replicas: it generated nothing of it); one that dies
mid-stream ends it with an SSE error event. A stream that ends otherwise than its 200 said (an error event,
or its client left before the end) writes how it ended to the request's `state["outcome"]` (the status the
access log and the requests metric count, proxy/http/middleware.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

from starlette.responses import Response, StreamingResponse

from moe_cohort.proxy.whole import unless_client_leaves
from moe_cohort.send.errors import CLIENT_CLOSED, ServiceError
from moe_cohort.send.lifecycle import Lifecycle

log = logging.getLogger(__name__)


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even when the client leaves before the first byte."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class StreamRelay:
    """A streamed answer of one request (`life`, not yet admitted); `state`: the request's ASGI state."""

    def __init__(self, life: Lifecycle, keepalive_s: float, state: dict | None = None) -> None:
        self.life, self.keepalive_s = life, keepalive_s
        self.state = {} if state is None else state
        self._admit = asyncio.ensure_future(life.admit())
        self._response = None
        self._streaming = self._ended = False  # the body began / came to its end

    async def start(self, receive) -> Response:
        """Return the response: relayed at once when admitted within keepalive_s, else keep-alives first. While
        it is admitted and its stream opened, the client's connection (ASGI `receive`, the body already read) is
        watched: a client that leaves then is answered 499 and its request ended (never sent, or its backend
        stream closed)."""
        try:
            opened = await unless_client_leaves(self._opened_in_time(), receive)
        except BaseException:
            await self.close()
            raise
        if opened is None:  # the client left
            await self.close()
            return Response(status_code=CLIENT_CLOSED)
        if not opened:
            return _ClosingStreamingResponse(self._queued_then_relay(), self.close)
        return _ClosingStreamingResponse(self._relay(), self.close, headers=self.life.response_headers())

    async def _opened_in_time(self) -> bool:
        """Whether the request was admitted within keepalive_s, and then its stream opened."""
        done, _ = await asyncio.wait({self._admit}, timeout=self.keepalive_s)
        if not done:
            return False
        await self._open()
        return True

    async def _open(self) -> None:
        self._admit.result()  # raises what the admission raised
        self._response = await self.life.open_stream()

    async def _relay(self) -> AsyncIterator[bytes]:
        self._streaming = True
        try:  # a replica that dies mid-stream: the client gets an SSE error event, the request is not resent
            async for chunk in self.life.slot.client.iter_raw(self._response):
                yield chunk
        except ServiceError as exc:
            log.warning("backend stream broke: %s", exc.message)
            yield self._failed(exc)
        self._ended = True

    async def _queued_then_relay(self) -> AsyncIterator[bytes]:
        self._streaming = True
        while not self._admit.done():
            yield b": queued\n\n"
            await asyncio.wait({self._admit}, timeout=self.keepalive_s)
        try:
            await self._open()
        except ServiceError as exc:
            yield self._failed(exc)
            self._ended = True
            return
        async for chunk in self._relay():
            yield chunk

    def _failed(self, exc: ServiceError) -> bytes:
        self.state["outcome"] = exc.status_code
        return _sse_error(exc)

    async def close(self) -> None:
        """Once, whatever happened: a queued request leaves the queue; an admitted one ends (send.lifecycle)."""
        if self._streaming and not self._ended:
            self.state.setdefault("outcome", CLIENT_CLOSED)  # the client left before the end
        if not self._admit.done():
            self._admit.cancel()  # the gate forgets the queued request
            with contextlib.suppress(BaseException):
                await self._admit
        await self.life.close()


def _sse_error(exc: ServiceError) -> bytes:
    body = exc.body()
    if hasattr(exc, "content"):  # a backend error status: relay its own body when it is JSON
        with contextlib.suppress(ValueError):
            body = json.loads(exc.content)
    return b"data: " + json.dumps(body).encode() + b"\n\n"
