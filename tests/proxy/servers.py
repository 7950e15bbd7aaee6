"""Servers for tests. `local_backend`: a throwaway HTTP server for backend failures a real vLLM
cannot be made to produce on demand (a 5xx, a hang, a dropped connection): aiohttp's low-level
server on 127.0.0.1, run in the test's own event loop; `handler(request) ->
aiohttp.web.StreamResponse` answers every request. `ProxyThread`: the proxy app under uvicorn in
a background thread, as `cohort serve` runs it."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import uvicorn
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.http.limits import server_options
from moe_cohort.proxy.settings import Settings


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


class ProxyThread:
    """uvicorn serving the proxy app (or `app`, an ASGI app of the same settings) in a background thread
    (its own event loop)."""

    def __init__(self, settings: Settings, app=None) -> None:
        options = {**server_options(settings), "host": "127.0.0.1"}  # as `cohort serve` runs it (head limits)
        self.server = uvicorn.Server(uvicorn.Config(app or create_app(settings), log_level="warning", **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{settings.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
