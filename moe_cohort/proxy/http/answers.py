"""Errors as the proxy answers them: the OpenAI error shape, counted in the metrics under a route label.

A ProxyError raised anywhere on a request's path ends here once (`error_answer`), as does an HTTP error of the
framework (an unknown route, a wrong method). The metrics' label is the route's name or template, never the raw
path: file and batch ids would reach /metrics, and every new path, even refused without a key, a new series.
"""

from __future__ import annotations

import logging
from typing import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_cohort.proxy.http.errors import BackendStatusError, ProxyError

log = logging.getLogger("moe_cohort.proxy.app")  # the proxy's own log lines, under one name


def error_answer(metrics, request: Request, exc: ProxyError, route: str) -> Response:
    """The answer to a ProxyError (the OpenAI error shape), counted in `metrics` (ProxyMetrics) under `route`."""
    metrics.requests.labels(route, str(exc.status_code)).inc()
    if isinstance(exc, BackendStatusError):  # the backend's own error, in the OpenAI shape
        content, media_type = exc.openai_content(f"{request.method} {request.url.path}")
        return Response(content, status_code=exc.status_code, media_type=media_type)
    log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status_code)


def add_error_handlers(app: FastAPI, metrics, paths: Mapping[str, str]) -> None:
    """`app` answers ProxyErrors and the framework's HTTP errors in the OpenAI shape; `paths`: route name -> path."""
    routes = {path: route for route, path in paths.items()}

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        template = getattr(request.scope.get("route"), "path", "unmatched")
        return error_answer(metrics, request, exc, routes.get(template, template))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = ProxyError(f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
        error.error_type = "invalid_request_error"
        return JSONResponse(error.body(), status_code=exc.status_code)
