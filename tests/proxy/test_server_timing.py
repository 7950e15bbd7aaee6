"""The Server-Timing header and cohort_proxy_seconds: the proxy's own time, apart from the backend's time
and the wait for a slot. The backend is a throwaway local server that takes a known time to answer, on a
clock of the test's own: the proxy's clocks stand still except when the backend moves them, so every time
the proxy reports is exact however loaded the machine is."""

import asyncio
import re
import time

import pytest
from aiohttp import web

from moe_cohort.send.replicas import ReplicaSet
from tests.helpers.proxy_client import CHAT, proxy_client, run
from tests.helpers.vllm_stub import OK_BODY, answer

BACKEND_S = 0.25  # how long the backend takes to answer, on the test's clock (a binary fraction: sums are exact)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """The proxy's clocks: perf_counter (its timings) and the admission clock (the wait for a slot)."""
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setitem(ReplicaSet.__init__.__kwdefaults__, "clock", clock)
    return clock


def timings(response) -> dict[str, float]:
    """{name: ms} of a Server-Timing header such as "proxy;dur=0.8, queue;dur=0.0, backend;dur=301.2"."""
    return {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([0-9.]+)", response.headers["server-timing"])}


def slow(clock, before=None):
    """A backend that takes BACKEND_S of `clock` to answer, once `before()` (awaited, if given) returns."""
    async def handler(request):
        if before is not None:
            await before()
        clock.now += BACKEND_S
        return answer(OK_BODY)
    return handler


def slow_stream(clock):
    async def handler(request):
        clock.now += BACKEND_S
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response
    return handler


def test_a_whole_answer_times_the_backend_apart_from_the_proxy(clock):
    async def main():
        async with proxy_client(slow(clock)) as c:
            response = await c.post("/v1/chat/completions", json=CHAT)
            metrics = (await c.get("/metrics")).text
        return response, metrics

    response, metrics = run(main())
    assert response.status_code == 200
    assert timings(response) == {"proxy": 0.0, "queue": 0.0, "backend": BACKEND_S * 1000}
    assert 'cohort_proxy_seconds_count{route="chat"} 1.0' in metrics


def test_a_stream_times_the_backend_until_its_first_bytes(clock):
    async def main():
        async with proxy_client(slow_stream(clock)) as c:
            async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
        return response, body

    response, body = run(main())
    assert body.endswith(b"data: [DONE]\n\n")
    assert timings(response) == {"proxy": 0.0, "queue": 0.0, "backend": BACKEND_S * 1000}


def test_the_wait_for_a_slot_is_the_queue_not_the_proxy(clock):
    calls = []

    async def main():
        async def second_waits():  # the first request holds its slot until the second waits for it
            calls.append(1)
            while len(calls) == 1 and "cohort_waiting 1.0" not in (await c.get("/metrics")).text:
                await asyncio.sleep(0.01)

        async with proxy_client(slow(clock, second_waits), max_in_flight=1) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT) for _ in range(2)))

    first, second = sorted(run(main()), key=lambda r: timings(r)["queue"])
    assert timings(first)["queue"] == 0.0
    assert timings(second) == {"proxy": 0.0, "queue": BACKEND_S * 1000, "backend": BACKEND_S * 1000}
