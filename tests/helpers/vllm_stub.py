"""Stand-in vLLM servers on real local sockets, for backend behaviour a real vLLM cannot be made to produce on
demand (a 5xx, a hang, a dropped connection, a replica that is down or dies with a request in hand).
`local_backend`: aiohttp's low-level server on 127.0.0.1, run in the test's own event loop; `handler(request) ->
aiohttp.web.StreamResponse` answers every request. `BackendThread`: the same in a background thread, for code
that runs its own loop. `EchoBackend`: a stdlib server in a thread. The answers they give: `answer`, `sse`, `drop`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

from aiohttp import web
from aiohttp.test_utils import RawTestServer


@contextlib.asynccontextmanager
async def local_backend(handler):
    """Serve `handler` on a free port; yields the base URL."""
    server = RawTestServer(handler, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def answer(body, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


async def body_of(request: web.BaseRequest) -> dict:
    return json.loads(await request.read())


def drop(request: web.BaseRequest) -> web.Response:
    """Close the connection without answering (a backend that died mid-request)."""
    request.transport.abort()
    return web.Response()


async def sse(request, *chunks, drop=False):
    """An event stream of `chunks`; with `drop`, the connection is cut instead of ending the stream."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
    if drop:
        await asyncio.sleep(0.01)
        request.transport.abort()
    else:
        await response.write_eof()
    return response


class BackendThread:
    """`handler` served by aiohttp in a background thread (its own event loop), for code that runs its own loop
    (a CLI's asyncio.run); `url` once entered."""

    def __init__(self, handler) -> None:
        self.handler, self.url = handler, ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        self._server = RawTestServer(self.handler, host="127.0.0.1")
        asyncio.run_coroutine_threadsafe(self._server.start_server(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.port}"
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def named(name: str, seen: list, health: dict | None = None):
    """A replica that answers with its name and records (name, path); /health answers 503 while health["down"]."""
    async def handler(request):
        seen.append((name, request.path))
        if request.path == "/health" and health is not None and health["down"]:
            return answer({"error": "starting"}, status=503)
        if request.path == "/v1/models":
            return answer({"object": "list", "data": [{"id": f"m-{name}"}, {"id": "shared", "owned_by": name}]})
        return answer({"replica": name})
    return handler


def refused_url() -> str:
    """A local port nobody listens on (a replica that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def dying_server(answer_head: bytes = b""):
    """A server that reads one request, sends `answer_head` (b"": nothing of an answer), stops listening
    and resets the connection: a backend killed with the request in hand (its port refuses from then on)."""
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        if answer_head:
            writer.write(answer_head)
            await writer.drain()
        server.close()  # the port refuses new connections
        writer.transport.abort()  # RST: the request was taken and will never be answered

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", got
    finally:
        server.close()


def alive_but_dropping(seen: list):
    """A replica that drops every POST without answering but answers /health: it may be generating."""
    async def handler(request):
        if request.path == "/health":
            return answer({})
        seen.append(("dropping", request.path))
        return drop(request)
    return handler


SEPARATORS = "one\u0085two\u2028three\u2029four"  # JSON allows them raw; str.splitlines() breaks at each


class EchoBackend:
    """A stdlib HTTP server in a thread: every POST answers a chat completion with SEPARATORS in its text; one
    with max_tokens 1, a 400 with SEPARATORS in its message. `bodies`: what it was sent."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                sent = json.loads(self.rfile.read(int(self.headers["content-length"])))
                bodies.append((self.path, sent))
                refused = sent.get("max_tokens") == 1
                body = json.dumps({"error": {"message": SEPARATORS, "type": "invalid_request_error"}} if refused else
                                  {"id": "c1", "object": "chat.completion", "model": "m", "choices": [
                                      {"index": 0, "message": {"role": "assistant", "content": SEPARATORS},
                                       "finish_reason": "stop"}]}, ensure_ascii=False).encode()
                self.send_response(400 if refused else 200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.bodies = bodies = []  # (path, body) of every POST, as the proxy forwarded it
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


OK_BODY = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}


async def ok(request):
    return answer(OK_BODY)
