"""Failures a real vLLM cannot be made to produce on demand (5xx, hangs, dropped streams), and the
proxy's own rejections. The backend is a throwaway local server (tests/proxy/servers.py); the proxy runs
in-process behind httpx.ASGITransport."""

import asyncio
import contextlib
import json
import re

import httpx
import openai
import pytest
from aiohttp import web

from moe_cohort.proxy.vllm_server import free_port
from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.settings import Settings
from tests.proxy.servers import ProxyThread, answer, body_of, local_backend

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
OK_BODY = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}


async def ok(request):
    return answer(OK_BODY)


@contextlib.asynccontextmanager
async def proxy_client(handler, **settings):
    """An httpx client of the in-process proxy, in front of a local server answering with `handler`."""
    async with local_backend(handler) as url:
        base = {"backend_url": url, "encoder": "none", **settings}
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


def test_backend_error_status_and_body_pass_through():
    async def overloaded(request):
        return answer({"error": {"message": "overloaded", "code": 503}}, status=503)

    resp = run(post(overloaded))
    assert resp.status_code == 503 and resp.json() == {"error": {"message": "overloaded", "code": 503}}


def test_backend_timeout_is_504_in_openai_shape():
    async def hang(request):
        await asyncio.sleep(5)
        return answer(OK_BODY)

    resp = run(post(hang, settings={"request_timeout_s": 0.2}))
    assert resp.status_code == 504
    error = resp.json()["error"]
    assert error["type"] == "timeout" and "did not answer in time" in error["message"]


def test_unreachable_backend_is_502_with_the_address():
    async def main():
        app = create_app(Settings(backend_url="http://127.0.0.1:9", encoder="none"))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                return await c.post("/v1/chat/completions", json=CHAT), await c.get("/health")
        finally:
            await app.state.proxy.close()

    resp, health = run(main())
    assert resp.status_code == 502 and "cannot reach the backend at http://127.0.0.1:9" in resp.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "backend unavailable"


def test_official_client_sees_openai_errors():
    async def main():
        async with proxy_client(ok) as http:
            oa = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="k", max_retries=0, http_client=http)
            with pytest.raises(openai.BadRequestError) as bad_policy:
                await oa.chat.completions.create(model="tiny", messages=CHAT["messages"],
                                                 extra_headers={"X-MoE-Routing": "xshare;m=zero"})
            with pytest.raises(openai.BadRequestError) as bad_field:
                await oa.chat.completions.create(model="tiny", messages=[])
        return bad_policy.value, bad_field.value

    bad_policy, bad_field = run(main())
    assert "invalid routing policy 'xshare;m=zero'" in bad_policy.message and bad_policy.code == "invalid_policy"
    assert "'messages' must be a non-empty list" in bad_field.message


def test_size_limit_and_invalid_json():
    async def main():
        async with proxy_client(ok, max_body_bytes=200) as c:
            too_large = await c.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 500})
            bad_json = await c.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
        return too_large, bad_json

    too_large, bad_json = run(main())
    assert too_large.status_code == 413 and "over the proxy's limit of 200 bytes" in too_large.json()["error"]["message"]
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]


def test_unknown_route_is_an_openai_error():
    async def main():
        async with proxy_client(ok) as c:
            return await c.get("/v1/nothing")

    resp = run(main())
    assert resp.status_code == 404 and resp.json()["error"]["message"].startswith("GET /v1/nothing")


def test_proxy_keys_and_backend_key():
    seen = []

    async def backend(request):
        seen.append(request.headers.get("authorization"))
        return answer(OK_BODY)

    async def main():
        async with proxy_client(backend, api_keys=("secret",), backend_api_key="vllm-key") as c:
            statuses = [(await c.post("/v1/chat/completions", json=CHAT)).status_code]
            wrong = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
            statuses.append((await c.post("/v1/chat/completions", json=CHAT,
                                          headers={"Authorization": "Bearer secret"})).status_code)
        async with proxy_client(backend) as c:
            statuses.append((await c.post("/v1/chat/completions", json=CHAT,
                                          headers={"Authorization": "Bearer client-key"})).status_code)
        return statuses, wrong

    statuses, wrong = run(main())
    assert statuses == [401, 200, 200] and wrong.json()["error"]["code"] == "invalid_api_key"
    assert seen == ["Bearer vllm-key", "Bearer client-key"]


def test_policy_reaches_the_backend_as_vllm_xargs():
    bodies = []

    async def backend(request):
        bodies.append(await body_of(request))
        return answer(OK_BODY)

    resp = run(post(backend, {**CHAT, "custom": 1}, headers={"X-MoE-Routing": "lynx-lat;drop=2"}))
    assert resp.status_code == 200 and resp.headers["x-cohort-admission"].startswith("a")
    assert bodies[0]["vllm_xargs"]["moe_routing"].startswith("lynx-lat") and bodies[0]["custom"] == 1


async def sse(request, *chunks, drop=False):
    """An event stream of `chunks`; with `drop`, the connection is cut instead of ending the stream."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
    if drop:
        await asyncio.sleep(0.01)
        request.transport.abort()
    else:
        await response.write_eof()
    return response


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
            settings = Settings(backend_url=url, port=free_port(), encoder="none")
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


def test_non_streaming_clients_that_leave_free_their_slots_and_close_the_backend_connection():
    """One slot: A holds it at a backend that never answers, B waits for it; both clients hang up. A's backend
    connection is closed (how vLLM learns to abort), B never reaches the backend, and the slot serves C."""
    arrived, a_closed = [], asyncio.Event()

    async def backend(request):
        content = (await body_of(request))["messages"][0]["content"]
        arrived.append(content)
        if content == "c":
            return answer(OK_BODY)
        response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "1000000"})
        await response.prepare(request)
        try:
            while True:  # an answer that never ends, until the proxy hangs up
                await response.write(b" ")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            a_closed.set()
            raise

    async def send(port, content):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": content}]}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return writer

    async def until(condition):
        for _ in range(1000):
            if await condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def main():
        async with local_backend(backend) as url:
            settings = Settings(backend_url=url, port=free_port(), encoder="none", max_in_flight=1)
            with ProxyThread(settings) as proxy:
                async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
                    async def gauge(name):
                        return float(re.search(rf"^{name} (\S+)$", (await c.get("/metrics")).text, re.M).group(1))

                    a = await send(settings.port, "a")
                    await until(lambda: _true(arrived == ["a"]))
                    b = await send(settings.port, "b")
                    await until(lambda: _equal(gauge("cohort_waiting"), 1))
                    b.close()  # B leaves while it waits, then A while at the backend
                    await until(lambda: _equal(gauge("cohort_waiting"), 0))
                    a.close()
                    await asyncio.wait_for(a_closed.wait(), 10)
                    await until(lambda: _equal(gauge("cohort_in_flight"), 0))
                    third = await c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "c"}]})
        return third

    assert run(main()).status_code == 200
    assert arrived == ["a", "c"]


async def _true(value):
    return value


async def _equal(awaitable, expected):
    return await awaitable == expected
