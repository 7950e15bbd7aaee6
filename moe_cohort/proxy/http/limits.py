"""Limits on a request's head (request line and headers), enforced while uvicorn parses it.

uvicorn's httptools parser (the one `cohort serve` runs: uvicorn[standard]) has no limit on headers:
it reads a head of any number and size of headers whole, into memory, and answers it. The protocols here count
while parsing and answer 431 in the OpenAI error shape, then close the connection, as soon as a head
passes `max_header_bytes` (request target + each header's name, value and 4 bytes of ": " and CRLF) or
`max_headers` headers:

- httptools: every header and the URL as the parser hands them over (exact), and the raw bytes of a
  head that has not ended yet (one huge header, which httptools keeps to itself until it ends; so at
  most one socket read past the limit is held);
- h11 (where httptools is missing): h11's own bound on an unfinished head (`h11_max_incomplete_event_size`),
  answered 431 instead of uvicorn's 400.

And a time limit, `timeout_s`: a connection that has not sent a whole request head within it (from its
opening, or from the end of its last answer) is closed. Without it a client that sends nothing, or its
headers a byte a second (slowloris), holds its connection for ever, and enough of them exhaust the
server's connections. A head under way when the limit passes is answered 408 first; an idle connection is just closed.

`HeadLimits.check` does the same count on an ASGI scope: proxy/http/middleware.py applies it to every request,
whatever server runs the app (a complete head that h11 read in one piece, or another ASGI server).
`server_options(settings)` are the uvicorn options that `cohort serve` (and the tests' ProxyThread) run with.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from moe_cohort.send.errors import ServiceError

log = logging.getLogger(__name__)


class HeadersTooLarge(ServiceError):
    status_code = 431
    error_type = "invalid_request_error"


@dataclass(frozen=True)
class HeadLimits:
    max_bytes: int
    max_count: int
    timeout_s: float = 10.0

    def problem(self, size: int, count: int) -> str | None:
        """Why a head of `size` bytes and `count` headers is refused (None: it is not)."""
        if count > self.max_count:
            return f"request has over {self.max_count} headers, the proxy's limit (max_headers, COHORT_MAX_HEADERS)"
        if size > self.max_bytes:
            return (f"request headers are over the proxy's limit of {self.max_bytes} bytes "
                    f"(max_header_bytes, COHORT_MAX_HEADER_BYTES; request target and headers together)")
        return None

    def check(self, scope) -> HeadersTooLarge | None:
        """The refusal of an ASGI http `scope` whose head is over the limits, else None."""
        headers = scope["headers"]
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(name) + len(value) + 4 for name, value in headers)
        problem = self.problem(size, len(headers))
        return None if problem is None else refusal(problem)


def refusal(problem: str) -> HeadersTooLarge:
    return HeadersTooLarge(problem, code="request_header_fields_too_large")


class HeadTimeout(ServiceError):
    status_code = 408
    error_type = "invalid_request_error"


def _answer_431(problem: str, default_headers) -> bytes:
    """The whole HTTP/1.1 answer: 431, the OpenAI error shape, connection closed."""
    return _answer(refusal(problem), b"431 Request Header Fields Too Large", default_headers)


def _answer(error: ServiceError, status: bytes, default_headers) -> bytes:
    """The whole HTTP/1.1 answer of `error` in the OpenAI error shape, connection closed."""
    body = json.dumps(error.body()).encode()
    head = [b"HTTP/1.1 " + status + b"\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a head over the limits."""


def httptools_protocol(limits: HeadLimits) -> type:
    """uvicorn's httptools protocol, counting each request's head as it is parsed."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # between a message's end (or the connection's start) and the next head's end
            self._heads = 0  # heads parsed on this connection
            self._raw = 0  # bytes fed while in a head, none of which completed one (a head still arriving)
            self._size = self._count = 0  # the current head's exact size and number of headers
            self._problem: str | None = None
            self._head_clock = None  # closes the connection unless a whole head arrives in time

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_clock = self.loop.call_later(limits.timeout_s, self._head_timed_out)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._head_clock is None and not self.transport.is_closing():  # the next head's time starts now
                self._head_clock = self.loop.call_later(limits.timeout_s, self._head_timed_out)

        def connection_lost(self, exc) -> None:
            self._stop_head_clock()
            super().connection_lost(exc)

        def _stop_head_clock(self) -> None:
            if self._head_clock is not None:
                self._head_clock.cancel()
                self._head_clock = None

        def _head_timed_out(self) -> None:
            self._head_clock = None
            if not self._in_head or self.transport.is_closing():
                return
            if self._raw or self._size:  # part of a head came: say why the connection ends
                problem = (f"the request head did not arrive whole within {limits.timeout_s:g} s "
                           f"(head_timeout_s, COHORT_HEAD_TIMEOUT_S); send it at once")
                log.warning("408 from %s: %s", "%s:%d" % self.client if self.client else "?", problem)
                self.transport.write(_answer(HeadTimeout(problem, code="request_timeout"), b"408 Request Timeout",
                                             self.server_state.default_headers))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            # uvicorn's own, with the head's limits: a parse stopped by them is a 431, not a 400
            self._unset_keepalive_if_required()
            in_head, heads = self._in_head, self._heads
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                if self._problem is not None:
                    self._refuse(self._problem)
                    return
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            if in_head and self._in_head and self._heads == heads:  # all of `data` belongs to an unfinished head
                self._raw += len(data)
                if self._raw > limits.max_bytes:
                    self._refuse(limits.problem(self._raw, 0))

        def _refuse(self, problem: str) -> None:
            log.warning("431 from %s: %s", "%s:%d" % self.client if self.client else "?", problem)
            self.transport.write(_answer_431(problem, self.server_state.default_headers))
            self.transport.close()

        def _grow(self, size: int, count: int) -> None:
            self._size += size
            self._count += count
            problem = limits.problem(self._size, self._count)
            if problem is not None:
                self._problem = problem
                raise _Refused(problem)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._size = self._count = 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._grow(len(url), 0)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._grow(len(name) + len(value) + 4, 1)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._heads, self._raw = False, self._heads + 1, 0
            self._size = self._count = 0
            self._stop_head_clock()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._raw = True, 0
            super().on_message_complete()

    return LimitedHttpToolsProtocol


def h11_protocol(limits: HeadLimits) -> type:
    """uvicorn's h11 protocol answering 431 (not 400) when an unfinished head passes h11's bound."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            held, _ = self.conn.trailing_data
            if len(held) <= limits.max_bytes:
                super().send_400_response(msg)
                return
            problem = limits.problem(len(held), 0)
            log.warning("431 from %s: %s", "%s:%d" % self.client if self.client else "?", problem)
            self.transport.write(_answer_431(problem, self.server_state.default_headers))
            self.transport.close()

    return LimitedH11Protocol


def limited_protocol(limits: HeadLimits) -> type:
    """The protocol uvicorn's "auto" would pick (httptools when installed, else h11), with the limits."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return h11_protocol(limits)
    return httptools_protocol(limits)


def server_options(settings) -> dict:
    """uvicorn.run's (and uvicorn.Config's) options for the proxy's `settings` (send/settings.py): its host,
    port, and the protocol with the head limits. An idle keep-alive connection is closed after head_timeout_s
    (10 s), not uvicorn's 5 s: httpx and the openai client drop theirs after 5 s, so the client closes first,
    never a connection the server closes as a request goes out on it (a ReadError, not retried for a POST)."""
    limits = HeadLimits(settings.max_header_bytes, settings.max_headers, settings.head_timeout_s)
    return dict(host=settings.host, port=settings.port, http=limited_protocol(limits),
                h11_max_incomplete_event_size=settings.max_header_bytes, timeout_keep_alive=settings.head_timeout_s)
