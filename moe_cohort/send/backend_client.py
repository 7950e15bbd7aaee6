"""The HTTP client for the vLLM backend; transport failures become proxy errors here, at the boundary.

It is aiohttp rather than httpx: on the proxy's hot path httpx costs far more CPU than aiohttp
per request, most of it httpcore scanning its connection pool (benchmarks.bench_proxy,
docs/results.md, "What does the proxy cost?"). The session is made lazily in the running event loop (aiohttp
sessions belong to one loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import aiohttp

from moe_cohort.send.errors import BackendStatusError, BackendTimeout, BackendUnreachable

log = logging.getLogger(__name__)

IDLE_S = 2.0  # how long an idle keep-alive connection to the backend is kept: below vLLM's 5 s keep-alive, with
# margin for a starved server, whose event loop may close a connection late or read a request late


@dataclass(frozen=True)
class BackendAnswer:
    """A whole backend response."""

    status_code: int
    content: bytes
    content_type: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class BackendClient:
    """POST/GET to `base_url` (the server root, without /v1) over one pooled keep-alive session; with `api_key`,
    every request carries it (`Authorization: Bearer`) unless the caller's headers give their own."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 max_connections: int = 512, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_connections = max_connections
        # timeout_s bounds each wait for bytes (a whole answer, or the next chunk of a stream)
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # pooled keep-alive connections
        self._fresh: aiohttp.ClientSession | None = None  # a new connection per request (the one retry)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def of(cls, settings, url: str) -> "BackendClient":
        """The client of the backend at `url` with the settings' timeouts and key (send.settings.Settings)."""
        return cls(url, timeout_s=settings.request_timeout_s,
                   connect_timeout_s=settings.connect_timeout_s, api_key=settings.backend_api_key)

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def request(self, method: str, path: str, *, json: dict | None = None,
                      headers: dict[str, str] | None = None) -> BackendAnswer:
        """Send and read the whole answer; raise BackendStatusError for 4xx/5xx. Cancelling it (the
        client left) closes the connection, which makes vLLM abort the request."""
        with _translated(self.base_url, answer_started=False):
            response = await self._open(method, path, json, headers)
        try:
            with _translated(self.base_url):
                answer = BackendAnswer(response.status, await response.read(),
                                       response.headers.get("content-type", "application/json"))
        finally:
            response.release()  # back to the pool when read to the end, else the connection is closed
        if answer.status_code >= 400:
            raise BackendStatusError(answer.status_code, answer.content, answer.content_type)
        return answer

    @contextlib.asynccontextmanager
    async def stream(self, path: str, *, json: dict, headers: dict[str, str] | None = None
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Open a streaming POST; the caller iterates `iter_raw(response)`. Leaving the block closes
        the connection, which makes vLLM abort the request (how a client disconnect propagates)."""
        with _translated(self.base_url, answer_started=False):
            response = await self._open("POST", path, json, headers)
        try:
            if response.status >= 400:
                with _translated(self.base_url):
                    content = await response.read()
                raise BackendStatusError(response.status, content, response.headers.get("content-type", "application/json"))
            yield response
        finally:
            response.release()  # back to the pool when read to the end, else the connection is closed

    async def _open(self, method: str, path: str, body: dict | None, headers: dict[str, str] | None
                    ) -> aiohttp.ClientResponse:
        """Send and wait for the answer's status line. Sent again, once and on a new connection, when the
        backend certainly did not receive the request (`_not_received`), or when the connection was reused from
        the pool and the backend closed it before the status line came back (`_unanswered`: a keep-alive
        connection the backend closed as the request reached it; a request whose connection closes is
        aborted by vLLM, so it is not generated twice). Never when a new connection broke after the request
        went out (the backend may be generating it), nor once the answer began."""
        sent = _Attempt()
        try:
            return await self._send(method, path, body, headers, sent)
        except aiohttp.ClientError as exc:
            if _not_received(exc):
                why = "the backend did not receive the request"
            elif sent.reused and _unanswered(exc):
                why = "the backend closed a reused connection before answering"
            else:
                raise
            log.warning("%s %s%s: %s: %s; %s, retrying once on a new connection",
                        method, self.base_url, path, type(exc).__name__, exc, why)
        return await self._send(method, path, body, headers, _Attempt(), fresh=True)

    async def alive(self, timeout_s: float) -> bool:
        """Whether the backend answers GET /health within `timeout_s` (the one liveness probe: `problem`)."""
        return await self.problem(timeout_s) is None

    async def problem(self, timeout_s: float, paths: Sequence[str] = ("/health",)) -> str | None:
        """Why the backend is not answering (None: it is): each of `paths` asked in turn on a fresh connection
        (a pooled one may be a stale connection to a server that died; a dead server's port refuses a new one at
        once), within `timeout_s` each, until one answers below 400."""
        said = "no path asked"
        for path in paths:
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
                    async with session.get(self.base_url + path, headers=self.auth) as response:
                        if response.status < 400:
                            return None
                        said = f"GET {path} answered {response.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return said

    async def iter_raw(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The bytes of an open stream as they arrive; a broken connection becomes a BackendError."""
        with _translated(self.base_url):
            async for chunk in response.content.iter_any():
                yield chunk

    def _send(self, method: str, path: str, body: dict | None, headers: dict[str, str] | None, sent: _Attempt,
              fresh: bool = False):
        headers = {**self.auth, **(headers or {})}
        if body is not None:
            headers = {**(headers or {}), "content-type": "application/json"}
        data = None if body is None else jsonlib.dumps(body).encode()
        return self._client(fresh).request(method, self.base_url + path, data=data, headers=headers,
                                           trace_request_ctx=sent)

    def _client(self, fresh: bool = False) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            for session in (self._session, self._fresh):
                if session is not None and not session.closed:
                    log.debug("event loop changed; opening a new backend session")
                    session.detach()
            # idle connections are dropped before vLLM's uvicorn closes them (IDLE_S); one it closes as a request
            # reaches it anyway (a starved server) is seen reused by `_Attempt.traced` and the request resent
            connector = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300, keepalive_timeout=IDLE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  trace_configs=[_Attempt.traced()])
            one_shot = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300, force_close=True)
            self._fresh = aiohttp.ClientSession(connector=one_shot, timeout=self.timeout)
            self._loop = loop
        return self._fresh if fresh else self._session


class _Attempt:
    """One send of a request; `reused`: its connection came from the pool (the last one it was given, should
    aiohttp itself try again on another)."""

    def __init__(self) -> None:
        self.reused = False

    @staticmethod
    def traced() -> aiohttp.TraceConfig:
        """A session's trace: each request's `_Attempt` (its trace_request_ctx) told how it got its connection."""
        trace = aiohttp.TraceConfig()

        async def reused(session, context, params) -> None:
            context.trace_request_ctx.reused = True

        async def created(session, context, params) -> None:
            context.trace_request_ctx.reused = False

        trace.on_connection_reuseconn.append(reused)
        trace.on_connection_create_end.append(created)
        return trace


def _not_received(exc: aiohttp.ClientError) -> bool:
    """Whether the backend certainly did not get the request: the connect failed (refused, unreachable),
    or the connection (a pooled one the backend had closed meanwhile) was found closed before the request
    was handed to it: aiohttp raises "Cannot write to closing transport", directly or as the cause of a
    ClientOSError, and nothing was written. A connection that breaks after the request went out, before
    or after the first byte of the answer, is not retried: the backend may be generating."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return True
    return any(isinstance(e, aiohttp.ClientConnectionResetError) and "closing transport" in str(e)
               for e in (exc, exc.__cause__))


def _unanswered(exc: aiohttp.ClientError) -> bool:
    """Whether the backend closed the connection before the answer's status line came back (aiohttp reports a
    status line it had read with the disconnect, in place of its message)."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) and isinstance(exc.message, str)


@contextlib.contextmanager
def _translated(base_url: str, *, answer_started: bool = True):
    """aiohttp's failures as BackendTimeout / BackendUnreachable; `answer_started` False while nothing of the
    answer has come back yet (the request's send and the wait for the status line)."""
    try:
        yield
    except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
        raise BackendTimeout(f"the backend at {base_url} did not answer in time ({type(exc).__name__}); "
                             f"raise request_timeout_s (COHORT_REQUEST_TIMEOUT_S) or check the backend's load") from exc
    except (aiohttp.ClientError, OSError) as exc:
        began = answer_started or isinstance(exc, aiohttp.ServerDisconnectedError) and not _unanswered(exc)
        raise BackendUnreachable(f"cannot reach the backend at {base_url} ({type(exc).__name__}: {exc}); "
                                 f"is vLLM running there?", answer_started=began) from exc
