"""The proxy app under uvicorn in a background thread, on a real port, as `cohort serve` runs it."""

from __future__ import annotations

import threading
import time

import uvicorn

from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.http.limits import server_options
from moe_cohort.send.settings import Settings


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
