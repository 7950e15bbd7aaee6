"""What every request through the proxy gets, whatever its route: a request id, an access log line, and
an OpenAI-shaped answer to an unexpected exception.

`RequestContext` is plain ASGI middleware (no BaseHTTPMiddleware, which would buffer streams and hide
client disconnects from the routes):

- the request id is the client's `x-request-id` when it is sane (1-128 characters of letters, digits and
  `-_.:/+=@`), else a new `req-<hex>`; it is written back into the request's headers (so the backend gets
  it, send/auth.py `backend_headers`) and onto every response, errors included;
- one line per request on the `moe_cohort.proxy.access` logger: method, path, status, duration in ms, request id;
  never a body or a query string (prompts are user data); 499 when the client left before an answer;
- the request's end, once (`on_end(scope, status)`: the requests metric): the status is how the request ended,
  the one a handler wrote to `scope["state"]["outcome"]` when it differs from the answer's first line (a
  stream that failed or whose client left after its 200), else that first line's, else 499;
- an exception that no handler turned into a response becomes a 500 in the OpenAI error shape naming
  the request id, logged with its traceback;
- a request whose head is over the limits (`limits`, proxy/http/limits.py) is answered 431 before any
  route sees it (`cohort serve`'s uvicorn protocol refuses most such heads while parsing them already).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Callable, Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_cohort.proxy.http.limits import HeadLimits
from moe_cohort.send.errors import CLIENT_CLOSED

log = logging.getLogger(__name__)
access_log = logging.getLogger("moe_cohort.proxy.access")

REQUEST_ID = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id_of(headers: list[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """The request id to use (the client's when sane, else a new one) and whether it is the client's."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if _SANE_ID.fullmatch(text):
                return text, True
            break
    return f"req-{uuid.uuid4().hex}", False


def error_body(message: str, request_id: str) -> bytes:
    """The OpenAI error shape of an unexpected failure."""
    return json.dumps({"error": {"message": f"{message} (request id {request_id})", "type": "internal_error",
                                 "param": None, "code": "internal_error"}}).encode()


def route_label(scope: Scope, names: Mapping[str, str]) -> str:
    """A request's route in the metrics: the name its fast path gave it (`scope["state"]["route"]`), else its
    route's template named by `names` (template -> name) or the template itself; "unmatched" without a route.
    Never the raw path: file and batch ids would reach /metrics, and every new path a new series."""
    named = scope.get("state", {}).get("route")
    if named:
        return named
    template = getattr(scope.get("route"), "path", "unmatched")
    return names.get(template, template)


class RequestContext:
    def __init__(self, app: ASGIApp, limits: HeadLimits | None = None,
                 on_end: Callable[[Scope, int], None] | None = None) -> None:
        self.app, self.limits, self.on_end = app, limits, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.limits.check(scope) if self.limits is not None else None  # the client's head, as sent
        request_id, sent = request_id_of(scope["headers"])
        if not sent:  # the backend gets the id the client sees (send/auth.py forwards the header)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"]
            scope["headers"].append((b"x-request-id", request_id.encode()))
        start, status = time.perf_counter(), [0]
        scope.setdefault("state", {}).update(request_id=request_id, started=start)  # started: for Server-Timing

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            if refused is not None:
                status[0] = refused.status_code
                body = json.dumps(refused.body()).encode()
                await send_with_id({"type": "http.response.start", "status": refused.status_code,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode()),
                                                (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # the client left while its body was being read: no one to answer
            pass
        except Exception:
            log.exception("%s %s failed (request id %s)", scope["method"], scope["path"], request_id)
            if status[0]:  # the answer has started: nothing else can be sent
                raise
            status[0] = 500
            body = error_body("internal error in the proxy; it is logged with its traceback", request_id)
            await send_with_id({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            ended = scope["state"].get("outcome") or status[0] or CLIENT_CLOSED
            access_log.info("%s %s %d %.1fms %s", scope["method"], scope["path"], ended,
                            (time.perf_counter() - start) * 1000, request_id)
            if self.on_end is not None:
                self.on_end(scope, ended)
