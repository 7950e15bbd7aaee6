"""The ASGI app `cohort serve` runs: it listens at once and answers while the proxy is being built.

Building the proxy (`create_app`) loads the encoder, and the first start with the default encoder
distils it (encoder/static.py), which takes minutes. A server that does not listen meanwhile looks dead
to a load balancer or an orchestrator's probe; this one answers at once:

    GET /health      503 {"status": "not ready", "detail": "loading the encoder"}   (the proxy's /health shape)
    anything else    503 in the OpenAI error shape (code "not_ready"), with Retry-After

`build()` runs in a daemon thread (a shutdown meanwhile does not wait for a distillation); when it
returns, the app's own lifespan starts and every request goes to it from then on. When it fails,
`/health` says so and `on_failed(exc)` tells the server to exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable

from starlette.applications import Starlette

from moe_cohort.send.errors import NotReady

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class Starting:
    def __init__(self, build: Callable[[], Starlette], *, on_ready: Callable[[], None] = lambda: None,
                 on_failed: Callable[[BaseException], None] = lambda exc: None, doing: str = "loading the encoder") -> None:
        self.build, self.on_ready, self.on_failed, self.doing = build, on_ready, on_failed, doing
        self.app: Starlette | None = None  # set once built and its lifespan has started
        self.failed: BaseException | None = None
        self._stopping = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._not_ready(scope, send)
        else:  # a websocket: refused until the app is there
            await send({"type": "websocket.close", "code": 1013})

    async def _lifespan(self, receive, send) -> None:
        await receive()  # lifespan.startup
        started = asyncio.get_running_loop().create_task(self._start())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        self._stopping.set()
        if self.app is None:  # still building: leave the thread (a daemon) behind
            started.cancel()
        try:
            await started
        except asyncio.CancelledError:
            pass
        await send({"type": "lifespan.shutdown.complete"})

    async def _start(self) -> None:
        try:
            app = await _in_daemon_thread(self.build)
        except Exception as exc:
            log.error("the proxy could not start: %s", exc, exc_info=exc)
            self.failed = exc
            self.on_failed(exc)
            return
        async with app.router.lifespan_context(app):
            self.app = app
            self.on_ready()
            await self._stopping.wait()

    async def _not_ready(self, scope, send) -> None:
        if self.failed is not None:
            status, body = 503, {"status": "failed", "detail": f"the proxy could not start: {self.failed}"}
        elif scope["path"] == "/health":
            status, body = 503, {"status": "not ready", "detail": self.doing}
        else:
            error = NotReady(f"the proxy is starting ({self.doing}); retry in a few seconds", code="not_ready")
            status, body = error.status_code, error.body()
        content = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": content})


async def _in_daemon_thread(fn: Callable[[], object]):
    """`fn()` in a daemon thread (asyncio.to_thread's threads are joined at exit: a shutdown would wait)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: the server is gone
            pass

    threading.Thread(target=run, name="cohort-start", daemon=True).start()
    return await future
