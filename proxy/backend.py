"""The HTTP client for the vLLM backend; transport failures become proxy errors here, at the boundary."""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import httpx

from proxy.errors import BackendStatusError, BackendTimeout, BackendUnreachable

log = logging.getLogger(__name__)


class BackendClient:
    """POST/GET to `base_url` (the server root, without /v1) with one pooled httpx.AsyncClient."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 max_connections: int = 512, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url, transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, *, json: dict | None = None,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        """Send and read the whole answer; raise BackendStatusError for 4xx/5xx."""
        with _translated(self.base_url):
            response = await self._client.request(method, path, json=json, headers=headers)
        _raise_for_status(response, response.content)
        return response

    @contextlib.asynccontextmanager
    async def stream(self, path: str, *, json: dict, headers: dict[str, str] | None = None
                     ) -> AsyncIterator[httpx.Response]:
        """Open a streaming POST; the caller iterates `iter_raw(response)`. Leaving the block closes
        the connection, which makes vLLM abort the request (how a client disconnect propagates)."""
        with _translated(self.base_url):
            async with self._client.stream("POST", path, json=json, headers=headers) as response:
                if response.status_code >= 400:
                    _raise_for_status(response, await response.aread())
                yield response

    async def iter_raw(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The bytes of an open stream as they arrive; a broken connection becomes a BackendError."""
        with _translated(self.base_url):
            async for chunk in response.aiter_raw():
                yield chunk


def _raise_for_status(response: httpx.Response, content: bytes) -> None:
    if response.status_code >= 400:
        raise BackendStatusError(response.status_code, content, response.headers.get("content-type", "application/json"))


@contextlib.contextmanager
def _translated(base_url: str):
    try:
        yield
    except httpx.TimeoutException as exc:
        raise BackendTimeout(f"the backend at {base_url} did not answer in time ({type(exc).__name__}); "
                             f"raise --request-timeout-s or check the backend's load") from exc
    except (httpx.TransportError, OSError) as exc:
        raise BackendUnreachable(f"cannot reach the backend at {base_url} ({type(exc).__name__}: {exc}); "
                                 f"is vLLM running there?") from exc
