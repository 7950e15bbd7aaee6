"""The API's own description, off unless the operator turns it on (`api_docs`, COHORT_API_DOCS): /openapi.json,
/docs (Swagger UI) and /redoc, each behind the proxy's key like every other route when keys are set.

FastAPI serves them by default, to anyone: a keyed proxy would tell every caller its routes, and /docs and
/redoc have the browser load JavaScript from a CDN (jsdelivr). Turned on, they need `Authorization: Bearer <key>`
on a keyed proxy, which a browser does not send by itself: read /openapi.json with a client (curl, the
SDK), or open /docs where the proxy has no keys.
"""

from __future__ import annotations

from typing import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

OPENAPI, DOCS, REDOC = "/openapi.json", "/docs", "/redoc"
OFF = {"openapi_url": None, "docs_url": None, "redoc_url": None}  # FastAPI(**OFF): none of FastAPI's own


def add_api_docs(app: FastAPI, authorize: Callable[[Mapping[str, str]], str]) -> None:
    """Serve the three routes on `app` (built with FastAPI(**OFF)), each checked by `authorize`."""

    @app.get(OPENAPI, include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        authorize(request.headers)
        return JSONResponse(app.openapi())

    @app.get(DOCS, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        authorize(request.headers)
        return get_swagger_ui_html(openapi_url=OPENAPI, title=f"{app.title} - Swagger UI")

    @app.get(REDOC, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        authorize(request.headers)
        return get_redoc_html(openapi_url=OPENAPI, title=f"{app.title} - ReDoc")
