"""Streams through the proxy: keep-alives while queued, chunks relayed as they arrive, a stream the backend
drops ends with an SSE error event."""

import asyncio
import json

import httpx
from aiohttp import web

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_client import CHAT, post, proxy_client, run
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import OK_BODY, answer, body_of, local_backend, sse


def test_stream_dropped_by_the_backend_ends_with_an_error_event():
    async def backend(request):
        return await sse(request, b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', drop=True)

    resp = run(post(backend, {**CHAT, "stream": True}))
    events = [e for e in resp.text.split("\n\n") if e]
    assert resp.status_code == 200 and events[0].startswith("data: {\"choices\"")
    assert "cannot reach the backend" in json.loads(events[-1].removeprefix("data: "))["error"]["message"]


def test_streaming_request_gets_keepalives_while_queued():
    holding, release = asyncio.Event(), asyncio.Event()

    async def backend(request):
        if (await body_of(request)).get("stream"):
            return await sse(request, b"data: [DONE]\n\n")
        holding.set()
        await release.wait()  # the first (non-streaming) request holds the only slot
        return answer(OK_BODY)

    async def main():
        async with proxy_client(backend, max_in_flight=1, keepalive_s=0.02) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
            await holding.wait()
            second = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "stream": True}))
            while "cohort_waiting 1.0" not in (await c.get("/metrics")).text:  # the second waits for the slot
                await asyncio.sleep(0.01)
            # one event loop: the relay's keep-alive timer (due 0.02 s after it began waiting) fires first
            await asyncio.sleep(0.1)
            release.set()
            return await first, await second

    first, second = run(main())
    assert first.status_code == 200
    assert second.text.startswith(": queued\n\n") and second.text.endswith("data: [DONE]\n\n")


def test_stream_chunks_are_relayed_as_they_arrive():
    """The backend holds its second event until the client has the first: a buffering proxy hangs."""
    first_seen = asyncio.Event()

    async def backend(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await first_seen.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def main():
        async with local_backend(backend) as url:
            settings = Settings(backends=(url,), port=free_port(), encoder="none")
            with ProxyThread(settings) as proxy:  # a real server: httpx.ASGITransport buffers whole bodies
                async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
                    async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                        chunks = resp.aiter_raw()
                        first = await asyncio.wait_for(anext(chunks), timeout=5)
                        first_seen.set()
                        rest = b"".join([chunk async for chunk in chunks])
        return first, rest

    first, rest = run(main())
    assert first == b'data: {"n": 1}\n\n' and rest == b"data: [DONE]\n\n"


def test_each_request_is_counted_once_by_how_it_ended_queued_streams_included():
    """One slot held by a whole answer; a queued stream whose client leaves counts 499, a queued stream whose
    backend answers 500 once admitted counts 500 (its client saw a 200 and then an error event), the whole
    answer 200: each once."""
    holding, release = asyncio.Event(), asyncio.Event()

    async def backend(request):
        if request.method != "POST":  # the handshake, the health probes
            return answer({"detail": "Not Found"}, 404)
        body = await body_of(request)
        if body.get("user") == "fails":
            return answer({"error": {"message": "engine error", "type": "server_error"}}, 500)
        if body.get("stream"):
            return await sse(request, b"data: [DONE]\n\n")
        holding.set()
        await release.wait()
        return answer(OK_BODY)

    def counted(text: str) -> dict[str, float]:
        return {line.split('status="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith('cohort_requests_total{route="chat"')}

    async def main():
        async with local_backend(backend) as url:
            settings = Settings(backends=(url,), port=free_port(), encoder="none", max_in_flight=1, keepalive_s=0.02)
            with ProxyThread(settings) as proxy:  # a real server: a client that leaves closes its connection
                async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
                    whole = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
                    await holding.wait()
                    async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as left:
                        assert (await anext(left.aiter_raw())).startswith(b": queued")
                    for _ in range(250):  # the proxy sees the connection close at its next keep-alive
                        if "499" in counted((await c.get("/metrics")).text):
                            break
                        await asyncio.sleep(0.02)
                    failing = asyncio.create_task(c.post("/v1/chat/completions",
                                                         json={**CHAT, "stream": True, "user": "fails"}))
                    while "cohort_waiting 1.0" not in (await c.get("/metrics")).text:
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.1)  # past its first keep-alive: answered 200 already
                    release.set()
                    whole, failing = await whole, await failing
                    for _ in range(500):  # counted once the answer's last byte is sent: just after the client read it
                        if len(counts := counted((await c.get("/metrics")).text)) == 3:
                            break
                        await asyncio.sleep(0.01)
                    return whole, failing, counts

    whole, failing, counts = run(main())
    assert whole.status_code == 200 and failing.status_code == 200 and '"engine error"' in failing.text
    assert counts == {"200": 1.0, "499": 1.0, "500": 1.0}
