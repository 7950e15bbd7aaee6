"""The generating routes' short way through the app: POST /v1/chat/completions, /v1/completions, /v1/responses.

Under load a large share of the proxy's CPU per request goes to FastAPI's layers around these hot
routes (py-spy on `cohort serve` under benchmarks/bench_proxy.py): route matching over every
route, the dependency solver, the exception and exit-stack middlewares, the response wrappers. The
proxy's own work (auth, parse, admit, forward) does not need them. `FastPath` is plain ASGI
middleware that sends these paths straight to their handlers and everything else on to the
app; the handlers and the error answers are the same functions the app's routes and exception
handlers use, so the two ways cannot drift apart. It sits inside `RequestContext`
(proxy/http/middleware.py): request ids, access log lines and the last-resort 500 are unchanged.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from moe_cohort.send.errors import ServiceError

Handler = Callable[[Request], Awaitable[Response]]
ErrorAnswer = Callable[[Request, ServiceError], Response]


class FastPath:
    """ASGI middleware: `routes` maps a POST path to (handler, its route's name in the metrics)."""

    def __init__(self, app: ASGIApp, routes: dict[str, tuple[Handler, str]], on_error: ErrorAnswer) -> None:
        self.app, self.routes, self.on_error = app, routes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:  # every other path and method: the app (405s, 404s, the other routes)
            await self.app(scope, receive, send)
            return
        handler, label = route
        scope.setdefault("state", {})["route"] = label  # proxy.http.middleware.route_label
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except ServiceError as exc:
            response = self.on_error(request, exc)
        await response(scope, receive, send)
