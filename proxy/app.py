"""The OpenAI-compatible proxy: FastAPI routes in front of a vLLM backend.

    POST /v1/chat/completions, POST /v1/completions   admitted by predicted experts, sent with a policy
    GET  /v1/models                                    relayed from the backend
    GET  /health, GET /metrics                         proxy + backend health, Prometheus text
    /v1/files, /v1/batches                             the OpenAI Batch API (proxy/batch_api.py)

`create_app(settings)` builds everything once: the settings, the backend client, the encoder
and profile head (the predictor), the admission gate and the metrics.
"""

from __future__ import annotations

import contextlib
import gc
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.auth import Authorizer, backend_headers
from proxy.backend import BackendClient
from proxy.batch_api import add_batch_api
from proxy.batch_jobs import BatchJobs
from proxy.admission import AdmissionGate, Profiler
from proxy.errors import BackendStatusError, ProxyError
from proxy.metrics import ProxyMetrics
from proxy.profiles import Predictor, make_predictor
from proxy.protocol import ProxyRequest, Route, check_size, cohort_headers, parse_request, with_profile
from proxy.settings import Settings, load_settings
from proxy.streaming import StreamRelay, Upstream

log = logging.getLogger(__name__)

PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class Proxy:
    """The request path, independent of routing: auth, parse, admit, forward, relay."""

    def __init__(self, settings: Settings, predictor: Predictor | None) -> None:
        self.settings, self.predictor = settings, predictor
        self.metrics = ProxyMetrics()
        self.backend = BackendClient.from_settings(settings)
        profiler = Profiler(predictor.predict, self.metrics.profile_seconds) if predictor else None
        self.gate = AdmissionGate(profiler, self.metrics, max_in_flight=settings.max_in_flight,
                                  max_queue_s=settings.max_queue_ms / 1000,
                                  **({"resident_factory": predictor.resident_factory} if predictor else {}))
        self.authorize = Authorizer(settings.api_keys)  # called with a request's headers
        self.upstream = Upstream(self.gate, self.backend, self.metrics, settings.keepalive_s)

    async def close(self) -> None:
        self.gate.close()
        await self.backend.close()

    async def completion(self, request: Request, route: Route) -> Response:
        self.authorize(request.headers)
        check_size(request.headers.get("content-length"), self.settings.max_body_bytes)
        preq = parse_request(await request.body(), route, request.headers,
                             default_policy=self.settings.default_policy, max_bytes=self.settings.max_body_bytes)
        if self.settings.log_prompts:
            log.info("%s request, policy %s: %r", route, preq.policy, preq.text)
        if preq.stream:
            relay = StreamRelay(self.upstream, preq, PATHS[route], backend_headers(self.settings, request.headers))
            return await relay.start()
        return await self._forward(preq, PATHS[route], backend_headers(self.settings, request.headers))

    async def _forward(self, preq: ProxyRequest, path: str, headers: dict[str, str]) -> Response:
        admission = await self.gate.admit(preq.text, preq.policy)
        try:
            with self.metrics.backend_seconds.labels(preq.route).time():
                answer = await self.backend.request("POST", path, json=with_profile(preq.body, admission), headers=headers)
        finally:
            self.gate.release(admission)
        self.metrics.requests.labels(preq.route, str(answer.status_code)).inc()
        return Response(answer.content, status_code=answer.status_code, headers=cohort_headers(admission),
                        media_type=answer.content_type)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app."""
    settings = settings or load_settings()
    if not settings.backend_url:
        raise ValueError("settings.backend_url is empty; pass --backend URL (or run `cohort serve` without it "
                         "to start the embedded vLLM backend)")
    proxy = Proxy(settings, make_predictor(settings))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await batch_jobs.resume()  # batches that were running when the proxy stopped
        # Everything loaded so far (encoder, FAISS, the app) lives as long as the process: keep it out
        # of the garbage collector's full passes, which otherwise stall every request in flight now
        # and then (13 ms for the ~67k objects of a proxy without encoder; more with torch loaded).
        # vLLM's API server does the same after startup.
        gc.collect()
        gc.freeze()
        yield
        await batch_jobs.close()
        await proxy.close()

    app = FastAPI(title="moe-cohort proxy", lifespan=lifespan)
    app.state.proxy = proxy
    _add_error_handlers(app, proxy)
    batch_jobs = BatchJobs(settings, proxy.backend, proxy.predictor, gate=proxy.gate)
    add_batch_api(app, batch_jobs, proxy.authorize, settings.max_file_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.completion(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.completion(request, "completion")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        proxy.authorize(request.headers)
        answer = await proxy.backend.request("GET", "/v1/models", headers=backend_headers(settings, request.headers))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        try:
            await proxy.backend.request("GET", "/health")
        except ProxyError as exc:
            return JSONResponse({"status": "backend unavailable", "backend": settings.backend_url,
                                 "detail": exc.message}, status_code=503)
        return JSONResponse({"status": "ok", "backend": settings.backend_url})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI, proxy: Proxy) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        proxy.metrics.requests.labels(_route_of(request), str(exc.status_code)).inc()
        if isinstance(exc, BackendStatusError):
            return Response(exc.content, status_code=exc.status_code, media_type=exc.content_type)
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = ProxyError(f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
        error.error_type = "invalid_request_error"
        return JSONResponse(error.body(), status_code=exc.status_code)


def _route_of(request: Request) -> str:
    return {path: route for route, path in PATHS.items()}.get(request.url.path, request.url.path)
