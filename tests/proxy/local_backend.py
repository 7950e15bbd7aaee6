"""A throwaway HTTP server for backend failures a real vLLM cannot be made to produce on demand
(a 5xx, a hang, a dropped connection): aiohttp's low-level server on 127.0.0.1, run in the test's
own event loop. `handler(request) -> aiohttp.web.StreamResponse` answers every request."""

from __future__ import annotations

import contextlib
import json

from aiohttp import web
from aiohttp.test_utils import RawTestServer


@contextlib.asynccontextmanager
async def local_backend(handler):
    """Serve `handler` on a free port; yields the base URL."""
    server = RawTestServer(handler, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def answer(body, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


async def body_of(request: web.BaseRequest) -> dict:
    return json.loads(await request.read())


def drop(request: web.BaseRequest) -> web.Response:
    """Close the connection without answering (a backend that died mid-request)."""
    request.transport.abort()
    return web.Response()
