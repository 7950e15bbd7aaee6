"""Server-sent events through the proxy: keep-alives while queued, then the backend's bytes as they come.

A streaming request waits for its turn up to `keepalive_s` before answering. Admitted by then
(the usual case), it opens the backend stream first, so a backend error keeps its own status
code; otherwise it answers 200 at once and sends SSE comments (`: queued`) until admitted, and a
later error arrives as an SSE `data: {"error": ...}` event, as vLLM itself reports errors mid-stream.
Whatever happens (finish, error, client disconnect) `close()` runs once: it closes the backend
connection, which makes vLLM abort the request, and frees the admission slot. With several
replicas the stream opens on the admission's replica; one that is down before any byte of the answer
came back passes the request to another (proxy.replicas: it generated nothing of it); one that dies
mid-stream ends it with an SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.responses import StreamingResponse

from moe_cohort.proxy.gate import AdmissionGate
from moe_cohort.proxy.http.errors import BackendUnreachable, ProxyError
from moe_cohort.proxy.learning import Learning
from moe_cohort.proxy.metrics import ProxyMetrics
from moe_cohort.proxy.cohort_key import cohort_key_header
from moe_cohort.proxy.protocol import ProxyRequest, cohort_headers, with_profile

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


@dataclass(frozen=True)
class Upstream:
    """What a relay uses: the dispatcher (`gate`, whose admissions name their replica's client), the
    metrics, the keep-alive interval."""

    gate: AdmissionGate
    metrics: ProxyMetrics
    keepalive_s: float
    learning: Learning | None = None  # told when a request leaves its replica (proxy.learning)


class StreamRelay:
    """`started`: when the request arrived (perf_counter, proxy.http.middleware), for the Server-Timing header."""

    def __init__(self, upstream: Upstream, preq: ProxyRequest, path: str, headers: dict[str, str],
                 started: float | None = None) -> None:
        self.up, self.preq, self.path, self.headers, self.started = upstream, preq, path, headers, started
        self._backend_s = 0.0  # the backend's time to answer the stream's status line (every replica tried)
        self._admit = asyncio.ensure_future(upstream.gate.admit(preq.text))
        self._admission = None  # the slot held (the admission, or the one a failover gave)
        self._opening = False  # from here on `_admission` is the slot held (None while between replicas)
        self._stream: contextlib.AbstractAsyncContextManager | None = None
        self._response = None
        self._closed = False

    async def start(self):
        """Return the response: relayed at once when admitted within keepalive_s, else keep-alives first."""
        try:
            done, _ = await asyncio.wait({self._admit}, timeout=self.up.keepalive_s)
            if not done:
                return _ClosingStreamingResponse(self._queued_then_relay(), self.close)
            await self._open()
        except BaseException:
            await self.close()
            raise
        own = self.up.metrics.own_time(self.preq.route, self.started, self._admission, self._backend_s)
        return _ClosingStreamingResponse(self._relay(), self.close,
                                         headers=cohort_headers(self._admission, self._backend_s, own))

    async def _open(self) -> None:
        """Open the stream on the admission's replica; one that is down before the answer began (it generated
        nothing of it) hands the request to another replica, when there is one."""
        self._admission, self._opening = self._admit.result(), True
        while True:
            admission = self._admission
            body = with_profile(self.preq.body, admission)
            headers = {**self.headers, **cohort_key_header(admission.prediction)}
            stream = admission.client.stream(self.path, json=body, headers=headers)
            sent = time.perf_counter()
            try:
                self._response = await stream.__aenter__()  # raises on a backend error status
                break
            except BackendUnreachable as exc:
                self._backend_s += time.perf_counter() - sent
                if not await self.up.gate.failover(admission, exc):
                    raise
                self._admission = None
                self.up.gate.release(admission)
                self._admission = await self.up.gate.readmit(admission)
        self._backend_s += time.perf_counter() - sent
        self._stream = stream
        self.up.metrics.requests.labels(self.preq.route, str(self._response.status)).inc()

    async def _relay(self) -> AsyncIterator[bytes]:
        try:  # a replica that dies mid-stream: the client gets an SSE error event, the request is not resent
            async for chunk in self._admission.client.iter_raw(self._response):
                yield chunk
        except ProxyError as exc:
            log.warning("backend stream broke: %s", exc.message)
            yield _sse_error(exc)

    async def _queued_then_relay(self) -> AsyncIterator[bytes]:
        while not self._admit.done():
            yield b": queued\n\n"
            await asyncio.wait({self._admit}, timeout=self.up.keepalive_s)
        try:
            await self._open()
        except ProxyError as exc:
            yield _sse_error(exc)
            return
        async for chunk in self._relay():
            yield chunk

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._admit.done():
            self._admit.cancel()  # the gate forgets the queued request
            return
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.__aexit__(None, None, None)
        if not self._opening and not self._admit.cancelled() and self._admit.exception() is None:
            self._admission = self._admit.result()  # admitted, never opened
        if self._admission is not None:
            if self.up.learning is not None:
                self.up.learning.finished(self._admission.client, self.preq.body, self.preq.text)
            self.up.gate.release(self._admission)
            self._admission = None


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
