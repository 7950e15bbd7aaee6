"""A whole (not streamed) answer, while its client stays: a client that leaves takes its request with it.

`reply(life, receive)` runs the request's Lifecycle (send/lifecycle.py) while watching the client's connection (ASGI
`receive`, the body already read); a client that leaves first cancels it, which closes its backend connection
(vLLM aborts the request; the lifecycle's own cleanup frees its slot), and is answered 499, never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from starlette.responses import Response

from moe_cohort.send.errors import CLIENT_CLOSED
from moe_cohort.send.lifecycle import Lifecycle

T = TypeVar("T")


async def reply(life: Lifecycle, receive) -> Response:
    answer = await unless_client_leaves(life.whole(), receive)
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    return Response(answer.content, status_code=answer.status_code, headers=answer.headers,
                    media_type=answer.content_type)


async def unless_client_leaves(work: Awaitable[T], receive) -> T | None:
    """Await `work` while watching the client's connection (ASGI `receive`): if the client leaves first, `work` is
    cancelled and the result is None."""
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
