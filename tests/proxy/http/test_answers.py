"""Errors in the OpenAI shape: the backend's own, a timeout (504), an unreachable backend (502), the proxy's
refusals (size, JSON, unknown routes), as the official client sees them. The backend is a throwaway local server
(tests/helpers/vllm_stub.py); the proxy runs in-process behind httpx.ASGITransport."""

import asyncio

import httpx
import openai
import pytest

from moe_cohort.proxy.app import create_app
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_client import CHAT, post, proxy_client, run
from tests.helpers.vllm_stub import OK_BODY, answer, ok


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
        app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none"))
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
