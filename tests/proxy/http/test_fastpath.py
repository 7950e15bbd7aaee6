"""The hot routes' short way (proxy/http/fastpath.py): its paths reach their handlers without the app, every
other path and method reaches the app, a ServiceError becomes the app's own error answer, and the request carries
its route's name for the metrics."""

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from moe_cohort.proxy.http.fastpath import FastPath
from moe_cohort.send.errors import InvalidRequest, ServiceError
from tests.helpers.proxy_client import CHAT, proxy_client
from tests.helpers.vllm_stub import ok


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_fast_paths_skip_the_app_and_others_reach_it():
    seen = []

    async def app_route(request):
        seen.append(("app", request.method, request.url.path))
        return PlainTextResponse("app")

    async def fast(request):
        seen.append(("fast", request.method, request.url.path, await request.body()))
        return PlainTextResponse("fast")

    def on_error(request, exc: ServiceError):
        return JSONResponse({**exc.body(), "label": request.scope["state"]["route"]}, status_code=exc.status_code)

    inner = Starlette(routes=[Route("/v1/completions", app_route, methods=["GET", "POST"]),
                              Route("/other", app_route, methods=["POST"])])
    app = FastPath(inner, {"/v1/completions": (fast, "completion")}, on_error)

    async def go():
        async with _client(app) as c:
            return [(r.status_code, r.text) for r in (await c.post("/v1/completions", content=b"{}"),
                                                      await c.get("/v1/completions"),
                                                      await c.post("/other"))]

    assert asyncio.run(go()) == [(200, "fast"), (200, "app"), (200, "app")]
    assert seen == [("fast", "POST", "/v1/completions", b"{}"), ("app", "GET", "/v1/completions"),
                    ("app", "POST", "/other")]


def test_a_proxy_error_on_a_fast_path_is_the_error_answer_with_its_label():
    async def fails(request):
        raise InvalidRequest("bad field", param="model")

    def on_error(request, exc: ServiceError):
        return JSONResponse({**exc.body(), "label": request.scope["state"]["route"]}, status_code=exc.status_code)

    app = FastPath(Starlette(), {"/v1/chat/completions": (fails, "chat")}, on_error)

    async def go():
        async with _client(app) as c:
            return await c.post("/v1/chat/completions", content=b"{}")

    resp = asyncio.run(go())
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "bad field", "type": "invalid_request_error", "param": "model",
                                     "code": None}, "label": "chat"}


def test_the_proxy_counts_fast_path_errors_under_the_route_and_keeps_405s_in_shape():
    async def go():
        async with proxy_client(ok) as c:
            good = await c.post("/v1/chat/completions", json=CHAT)
            bad = await c.post("/v1/chat/completions", content=b"{not json", headers={"x-request-id": "rid-1"})
            wrong_method = await c.get("/v1/completions")
            metrics = (await c.get("/metrics")).text
            return good, bad, wrong_method, metrics

    good, bad, wrong_method, metrics = asyncio.run(go())
    assert good.status_code == 200 and good.headers["x-request-id"]
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert bad.headers["x-request-id"] == "rid-1"  # RequestContext still wraps the fast path
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert 'cohort_requests_total{route="chat",status="400"} 1.0' in metrics
    assert 'cohort_requests_total{route="chat",status="200"} 1.0' in metrics  # each counted once
    assert 'cohort_requests_total{route="completion",status="405"} 1.0' in metrics  # the route's, not the fast path's
