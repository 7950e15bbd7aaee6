"""The Server-Timing header and cohort_proxy_seconds: the proxy's own time, apart from the backend's time
and the wait for a slot. The backend is a throwaway local server that takes a known time to answer."""

import asyncio
import re

from aiohttp import web

from tests.proxy.servers import answer
from tests.proxy.test_failures import CHAT, OK_BODY, proxy_client, run

BACKEND_S = 0.3  # how long the backend takes to answer; the proxy's own time is a few ms


def timings(response) -> dict[str, float]:
    """{name: ms} of a Server-Timing header such as "proxy;dur=0.8, queue;dur=0.0, backend;dur=301.2"."""
    return {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([0-9.]+)", response.headers["server-timing"])}


async def slow(request):
    await asyncio.sleep(BACKEND_S)
    return answer(OK_BODY)


async def slow_stream(request):
    await asyncio.sleep(BACKEND_S)
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
    await response.write_eof()
    return response


def test_a_whole_answer_times_the_backend_apart_from_the_proxy():
    async def main():
        async with proxy_client(slow) as c:
            response = await c.post("/v1/chat/completions", json=CHAT)
            metrics = (await c.get("/metrics")).text
        return response, metrics

    response, metrics = run(main())
    t = timings(response)
    assert response.status_code == 200 and set(t) == {"proxy", "queue", "backend"}
    assert t["backend"] >= BACKEND_S * 1000 and t["proxy"] < BACKEND_S * 1000 / 3 and t["queue"] < 50
    assert 'cohort_proxy_seconds_count{route="chat"} 1.0' in metrics


def test_a_stream_times_the_backend_until_its_first_bytes():
    async def main():
        async with proxy_client(slow_stream) as c:
            async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
        return response, body

    response, body = run(main())
    t = timings(response)
    assert body.endswith(b"data: [DONE]\n\n")
    assert t["backend"] >= BACKEND_S * 1000 and t["proxy"] < BACKEND_S * 1000 / 3


def test_the_wait_for_a_slot_is_the_queue_not_the_proxy():
    async def main():
        async with proxy_client(slow, max_in_flight=1) as c:  # the second request waits for the first's slot
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT) for _ in range(2)))

    first, second = sorted(run(main()), key=lambda r: timings(r)["queue"])
    waited = timings(second)
    assert timings(first)["queue"] < 50 and waited["queue"] >= BACKEND_S * 1000 * 0.8
    assert waited["proxy"] < BACKEND_S * 1000 / 3 and waited["backend"] >= BACKEND_S * 1000
