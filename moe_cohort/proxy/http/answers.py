"""Errors as the proxy answers them: the OpenAI error shape.

A ServiceError raised anywhere on a request's path ends here once (`error_answer`), as does an HTTP error of the
framework (an unknown route, a wrong method). The requests metric counts them where every request ends
(proxy/http/middleware.py).
"""

from __future__ import annotations

import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_cohort.send.errors import BackendStatusError, ServiceError

log = logging.getLogger("moe_cohort.proxy.app")  # the proxy's own log lines, under one name


def error_answer(request: Request, exc: ServiceError) -> Response:
    """The answer to a ServiceError (the OpenAI error shape)."""
    if isinstance(exc, BackendStatusError):  # the backend's own error, in the OpenAI shape
        content, media_type = exc.openai_content(f"{request.method} {request.url.path}")
        return Response(content, status_code=exc.status_code, media_type=media_type)
    log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status_code)


def add_error_handlers(app: FastAPI) -> None:
    """`app` answers ServiceErrors and the framework's HTTP errors in the OpenAI shape."""

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        return error_answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = ServiceError(f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
        error.error_type = "invalid_request_error"
        return JSONResponse(error.body(), status_code=exc.status_code)
