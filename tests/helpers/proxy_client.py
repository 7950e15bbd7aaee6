"""The proxy in-process behind httpx.ASGITransport, in front of a stand-in vLLM (tests/helpers/vllm_stub.py):
`proxy_client` yields a client of it, `post` sends one request (CHAT by default), `run` runs a coroutine."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from moe_cohort.proxy.app import create_app
from moe_cohort.send.settings import Settings
from tests.helpers.vllm_stub import local_backend

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@contextlib.asynccontextmanager
async def proxy_client(handler, **settings):
    """An httpx client of the in-process proxy, in front of a local server answering with `handler`."""
    async with local_backend(handler) as url:
        base = {"backends": (url,), "encoder": "none", **settings}
        app = create_app(Settings(**base))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                yield c
        finally:
            await app.state.proxy.close()


async def post(handler, body=CHAT, path="/v1/chat/completions", settings=None, **kw):
    async with proxy_client(handler, **(settings or {})) as c:
        return await c.post(path, json=body, **kw)


def run(coro):
    return asyncio.run(coro)
