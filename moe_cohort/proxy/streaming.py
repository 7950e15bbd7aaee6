"""Server-sent events through the proxy: keep-alives while queued, then the backend's bytes as they come.

A streaming request waits for its turn up to `keepalive_s` before answering. Admitted by then
(the usual case), it opens the backend stream first, so a backend error keeps its own status
code; otherwise it answers 200 at once and sends SSE comments (`: queued`) until admitted, and a
later error arrives as an SSE `data: {"error": ...}` event, as vLLM itself reports errors mid-stream.
Whatever happens (finish, error, client disconnect) `close()` runs once: it closes the backend
connection, which makes vLLM abort the request, and frees its slot (proxy/lifecycle.py). With several
replicas the stream opens on its slot's replica; one that is down before any byte of the answer
came back passes the request to another (proxy.replicas: it generated nothing of it); one that dies
mid-stream ends it with an SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.responses import StreamingResponse

from moe_cohort.proxy.http.errors import ProxyError
from moe_cohort.proxy.lifecycle import Lifecycle
from moe_cohort.proxy.metrics import ProxyMetrics
from moe_cohort.proxy.protocol import cohort_headers

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    """A streamed answer of one request (`life`, not yet admitted). `started`: when the request arrived
    (perf_counter, proxy.http.middleware), for the Server-Timing header."""

    def __init__(self, life: Lifecycle, route: str, metrics: ProxyMetrics, keepalive_s: float,
                 started: float | None = None) -> None:
        self.life, self.route, self.metrics, self.keepalive_s, self.started = life, route, metrics, keepalive_s, started
        self._admit = asyncio.ensure_future(life.admit())
        self._response = None

    async def start(self):
        """Return the response: relayed at once when admitted within keepalive_s, else keep-alives first."""
        try:
            done, _ = await asyncio.wait({self._admit}, timeout=self.keepalive_s)
            if not done:
                return _ClosingStreamingResponse(self._queued_then_relay(), self.close)
            await self._open()
        except BaseException:
            await self.close()
            raise
        slot = self.life.granted
        own = self.metrics.own_time(self.route, self.started, slot, self.life.backend_s)
        return _ClosingStreamingResponse(self._relay(), self.close,
                                         headers=cohort_headers(slot, self.life.backend_s, own))

    async def _open(self) -> None:
        self._admit.result()  # raises what the admission raised
        self._response = await self.life.open_stream()
        self.metrics.requests.labels(self.route, str(self._response.status)).inc()

    async def _relay(self) -> AsyncIterator[bytes]:
        try:  # a replica that dies mid-stream: the client gets an SSE error event, the request is not resent
            async for chunk in self.life.slot.client.iter_raw(self._response):
                yield chunk
        except ProxyError as exc:
            log.warning("backend stream broke: %s", exc.message)
            yield _sse_error(exc)

    async def _queued_then_relay(self) -> AsyncIterator[bytes]:
        while not self._admit.done():
            yield b": queued\n\n"
            await asyncio.wait({self._admit}, timeout=self.keepalive_s)
        try:
            await self._open()
        except ProxyError as exc:
            yield _sse_error(exc)
            return
        async for chunk in self._relay():
            yield chunk

    async def close(self) -> None:
        """Once, whatever happened: a queued request leaves the queue; an admitted one ends (proxy.lifecycle)."""
        if not self._admit.done():
            self._admit.cancel()  # the gate forgets the queued request
            with contextlib.suppress(BaseException):
                await self._admit
        await self.life.close()


async def unless_client_leaves(work: Awaitable[T], receive) -> T | None:
    """Await `work` (admission, then the backend's whole answer) while watching the client's connection
    (ASGI `receive`, the request body already read): if the client leaves first, `work` is cancelled,
    which closes its backend connection (vLLM aborts the request; the work's own cleanup frees its
    admission slot), and the result is None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # let its cleanup run before the answer goes
        return None
    return task.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse_error(exc: ProxyError) -> bytes:
    body = exc.body()
    if hasattr(exc, "content"):  # a backend error status: relay its own body when it is JSON
        with contextlib.suppress(ValueError):
            body = json.loads(exc.content)
    return b"data: " + json.dumps(body).encode() + b"\n\n"
