"""Failures a real vLLM cannot be made to produce on demand (5xx, hangs, dropped streams), and the
proxy's own rejections. The backend is an httpx.MockTransport; the proxy runs in-process."""

import asyncio
import json

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.settings import Settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
OK_BODY = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}


def make_app(handler, **settings):
    base = {"backend_url": "http://backend.test", "encoder": "none", "max_wait_ms": 0, **settings}
    return create_app(Settings(**base), transport=httpx.MockTransport(handler))


def client(app, **kw):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", **kw)


async def post(app, body=CHAT, path="/v1/chat/completions", **kw):
    async with client(app) as c:
        return await c.post(path, json=body, **kw)


def run(coro):
    return asyncio.run(coro)


def test_backend_error_status_and_body_pass_through():
    app = make_app(lambda r: httpx.Response(503, json={"error": {"message": "overloaded", "code": 503}}))
    resp = run(post(app))
    assert resp.status_code == 503 and resp.json() == {"error": {"message": "overloaded", "code": 503}}


def test_backend_timeout_is_504_in_openai_shape():
    def hang(request):
        raise httpx.ReadTimeout("timed out", request=request)

    resp = run(post(make_app(hang)))
    assert resp.status_code == 504
    error = resp.json()["error"]
    assert error["type"] == "timeout" and "did not answer in time" in error["message"]


def test_unreachable_backend_is_502_with_the_address():
    app = create_app(Settings(backend_url="http://127.0.0.1:9", encoder="none", max_wait_ms=0))
    resp = run(post(app))
    assert resp.status_code == 502 and "cannot reach the backend at http://127.0.0.1:9" in resp.json()["error"]["message"]
    health = run(_get(app, "/health"))
    assert health.status_code == 503 and health.json()["status"] == "backend unavailable"


async def _get(app, path, **kw):
    async with client(app) as c:
        return await c.get(path, **kw)


def test_official_client_sees_openai_errors():
    async def main():
        app = make_app(lambda r: httpx.Response(200, json=OK_BODY))
        oa = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="k", max_retries=0, http_client=client(app))
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
    app = make_app(lambda r: httpx.Response(200, json=OK_BODY), max_body_bytes=200)
    resp = run(post(app, {**CHAT, "pad": "x" * 500}))
    assert resp.status_code == 413 and "over the proxy's limit of 200 bytes" in resp.json()["error"]["message"]
    async def bad_json():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    resp = run(bad_json())
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


def test_unknown_route_is_an_openai_error():
    resp = run(_get(make_app(lambda r: httpx.Response(200)), "/v1/nothing"))
    assert resp.status_code == 404 and resp.json()["error"]["message"].startswith("GET /v1/nothing")


def test_proxy_keys_and_backend_key():
    seen = []

    def backend(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=OK_BODY)

    app = make_app(backend, api_keys=("secret",), backend_api_key="vllm-key")
    assert run(post(app)).status_code == 401
    assert run(post(app, headers={"Authorization": "Bearer wrong"})).json()["error"]["code"] == "invalid_api_key"
    assert run(post(app, headers={"Authorization": "Bearer secret"})).status_code == 200
    open_app = make_app(backend)
    assert run(post(open_app, headers={"Authorization": "Bearer client-key"})).status_code == 200
    assert seen == ["Bearer vllm-key", "Bearer client-key"]


def test_policy_reaches_the_backend_as_vllm_xargs():
    bodies = []

    def backend(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=OK_BODY)

    resp = run(post(make_app(backend), {**CHAT, "custom": 1}, headers={"X-MoE-Routing": "lynx-lat;drop=2"}))
    assert resp.status_code == 200 and resp.headers["x-cohort-batch"].startswith("b")
    assert bodies[0]["vllm_xargs"]["moe_routing"].startswith("lynx-lat") and bodies[0]["custom"] == 1


class _SSE(httpx.AsyncByteStream):
    """A backend event stream: `chunks`, then `error` raised (a dropped connection) if given."""

    def __init__(self, chunks, error=None):
        self.chunks, self.error = chunks, error

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.error:
            raise self.error


def sse(*chunks, error=None):
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_SSE(chunks, error))


def test_stream_dropped_by_the_backend_ends_with_an_error_event():
    app = make_app(lambda r: sse(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
                                 error=httpx.ReadError("connection reset by peer")))
    resp = run(post(app, {**CHAT, "stream": True}))
    events = [e for e in resp.text.split("\n\n") if e]
    assert resp.status_code == 200 and events[0].startswith("data: {\"choices\"")
    assert "cannot reach the backend" in json.loads(events[-1].removeprefix("data: "))["error"]["message"]


def test_streaming_request_gets_keepalives_while_queued():
    release = asyncio.Event()

    async def backend(request):
        if json.loads(request.content).get("stream"):
            return sse(b"data: [DONE]\n\n")
        await release.wait()  # the first (non-streaming) request holds the only slot
        return httpx.Response(200, json=OK_BODY)

    async def main():
        app = make_app(backend, max_in_flight=1, keepalive_s=0.02)
        async with client(app) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "stream": True}))
            await asyncio.sleep(0.1)
            release.set()
            return await first, await second

    first, second = run(main())
    assert first.status_code == 200
    assert second.text.startswith(": queued\n\n") and second.text.endswith("data: [DONE]\n\n")
