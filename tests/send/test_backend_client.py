"""The backend client's connection handling against a local server: keep-alive reuse (the proxy's
latency depends on it), a finished stream returning its connection, an abandoned stream closing
its own (how vLLM learns to abort), errors translated at the boundary, and the one retry, on a new
connection, of a request the backend certainly did not receive or that it closed a reused connection on
before answering (never of one it may have started on a new connection, nor of one whose answer began)."""

import asyncio
import contextlib
import logging
import socket

import pytest
from aiohttp import web

from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendStatusError, BackendUnreachable
from tests.helpers.vllm_stub import answer, local_backend


def peer_port(request) -> int:
    return request.transport.get_extra_info("peername")[1]


async def serve_and_record(ports: list[int], request):
    ports.append(peer_port(request))
    if request.path == "/stream":
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response
    return answer({"path": request.path})


def test_requests_reuse_one_connection_and_stream_end_returns_it():
    ports: list[int] = []

    async def main():
        async with local_backend(lambda r: serve_and_record(ports, r)) as url:
            client = BackendClient(url)
            try:
                for _ in range(3):
                    assert (await client.request("POST", "/a", json={"x": 1})).content == b'{"path": "/a"}'
                async with client.stream("/stream", json={}) as response:
                    chunks = [c async for c in client.iter_raw(response)]
                await client.request("GET", "/b")
            finally:
                await client.close()
        return chunks

    chunks = asyncio.run(main())
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(ports) == 5 and len(set(ports)) == 1


def test_abandoned_stream_closes_its_connection():
    disconnected = asyncio.Event()

    async def endless(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: more\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):  # the server noticed the client leave
            disconnected.set()
            raise

    async def main():
        async with local_backend(endless) as url:
            client = BackendClient(url)
            try:
                async with client.stream("/stream", json={}) as response:
                    async for _ in client.iter_raw(response):
                        break  # the client went away after the first chunk
                await asyncio.wait_for(disconnected.wait(), timeout=5)
            finally:
                await client.close()

    asyncio.run(main())  # times out unless the backend saw the connection close


def test_error_status_keeps_the_backends_body_and_client_survives_a_new_event_loop():
    async def handler(request):
        return answer({"error": {"message": "no such model"}}, status=404)

    async def call(client_or_none):
        async with local_backend(handler) as url:
            client = client_or_none or BackendClient(url)
            client.base_url = url
            with pytest.raises(BackendStatusError) as exc:
                await client.request("POST", "/v1/completions", json={})
            return client, exc.value

    client, first = asyncio.run(call(None))
    _, second = asyncio.run(call(client))  # the same client from another event loop (tests, reloads)
    asyncio.run(client.close())
    assert first.status_code == second.status_code == 404
    assert first.content == b'{"error": {"message": "no such model"}}'


RETRY_LOG = "the backend did not receive the request, retrying once"
RETRIED = "retrying once on a new connection"  # every retry's log line


def test_refused_connect_is_retried_exactly_once_then_unreachable(caplog):
    from moe_cohort.embedded.vllm_server import free_port

    async def main():
        client = BackendClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
        try:
            with pytest.raises(BackendUnreachable) as exc:
                await client.request("POST", "/v1/completions", json={"prompt": "x"})
            return exc.value
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.send.backend_client"):
        error = asyncio.run(main())
    assert "cannot reach the backend" in error.message
    assert sum(RETRY_LOG in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("how", ["accepted then died", "answering then died"])
def test_a_request_the_backend_may_have_started_is_never_retried(how, caplog):
    received = []

    async def dies(request):
        received.append(await request.read())
        if how == "answering then died":  # the status line and part of the body went out
            response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "100"})
            await response.prepare(request)
            await response.write(b'{"id": ')
            await asyncio.sleep(0.01)
        request.transport.abort()
        return web.Response()

    async def main():
        async with local_backend(dies) as url:
            client = BackendClient(url)
            try:
                with pytest.raises(BackendUnreachable):
                    await client.request("POST", "/v1/completions", json={"prompt": "x"})
                with pytest.raises(BackendUnreachable):
                    async with client.stream("/v1/completions", json={"prompt": "y"}) as response:
                        [c async for c in client.iter_raw(response)]
            finally:
                await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.send.backend_client"):
        asyncio.run(main())
    assert received == [b'{"prompt": "x"}', b'{"prompt": "y"}']  # each request reached the backend once
    assert not any(RETRY_LOG in r.getMessage() for r in caplog.records)


def test_a_refused_connect_succeeds_when_the_backend_comes_up_before_the_retry():
    """The port starts listening (the kernel queues the retry's connection) as the retry is logged; the
    server then answers it: the caller gets the answer, not a 502."""
    from moe_cohort.embedded.vllm_server import free_port

    port, listening = free_port(), socket.socket()

    class OpenThePort(logging.Handler):
        def emit(self, record):
            if RETRY_LOG in record.getMessage():
                listening.bind(("127.0.0.1", port))
                listening.listen()

    async def main():
        client = BackendClient(f"http://127.0.0.1:{port}")
        call = asyncio.ensure_future(client.request("POST", "/v1/completions", json={"prompt": "x"}))
        while listening.getsockname()[1] != port and not call.done():  # until the first attempt was refused
            await asyncio.sleep(0.01)
        runner = web.ServerRunner(web.Server(lambda request: serve_and_record([], request)))
        await runner.setup()
        await web.SockSite(runner, listening).start()
        try:
            return (await call).content
        finally:
            await client.close()
            await runner.cleanup()

    handler = OpenThePort()
    logging.getLogger("moe_cohort.send.backend_client").addHandler(handler)
    try:
        assert asyncio.run(main()) == b'{"path": "/v1/completions"}'
    finally:
        logging.getLogger("moe_cohort.send.backend_client").removeHandler(handler)
        listening.close()


def test_the_liveness_probe_says_why_asks_its_paths_in_turn_and_sends_the_key():
    """`problem` (and `alive`, the same probe on /health): a server whose /health fails but whose /v1/models answers
    is up for a caller that asks both, down for one that asks /health only; a closed port says how it failed."""
    keys = []

    async def server(request):
        keys.append(request.headers.get("authorization"))
        return answer({"data": []}) if request.path == "/v1/models" else answer({"detail": "engine dead"}, 500)

    async def main():
        async with local_backend(server) as url:
            client = BackendClient(url, api_key="k")
            said = (await client.problem(2.0), await client.problem(2.0, ("/health", "/v1/models")),
                    await client.alive(2.0))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = BackendClient(f"http://127.0.0.1:{s.getsockname()[1]}")
            return said, await closed.problem(2.0)

    (health_only, both, alive), refused = asyncio.run(main())
    assert health_only == "GET /health answered 500" and both is None and alive is False
    assert refused.startswith("ClientConnectorError") and set(keys) == {"Bearer k"}


OK_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@contextlib.asynccontextmanager
async def scripted_server(script):
    """A raw HTTP/1.1 server: the `r`-th request (from 0) of its `c`-th connection is read whole, then answered
    with `script(c, r)`: (bytes to send, whether to close the connection after them). Yields the URL and the
    (c, r) of every request read."""
    got: list[tuple[int, int]] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        c, connections = connections, connections + 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for r in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                               if line.startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                got.append((c, r))
                sent, close = await script(c, r)
                writer.write(sent)
                await writer.drain()
                if close:
                    break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", got
    finally:
        server.close()


async def send(client: BackendClient, how: str) -> bytes:
    if how == "whole":
        return (await client.request("POST", "/v1/completions", json={"prompt": "x"})).content
    async with client.stream("/v1/completions", json={"prompt": "x"}) as response:
        return b"".join([c async for c in client.iter_raw(response)])


def unreachable(script, how: str, caplog, pooled: bool = False) -> tuple[BackendUnreachable, list]:
    """The BackendUnreachable a request `how` gets from a `scripted_server(script)` (after one answered request
    that leaves its connection in the pool, with `pooled`), and what the server got."""
    async def main():
        async with scripted_server(script) as (url, got):
            client = BackendClient(url)
            try:
                if pooled:
                    await send(client, "whole")
                with pytest.raises(BackendUnreachable) as caught:
                    await send(client, how)
                return caught.value, got
            finally:
                await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.send.backend_client"):
        return asyncio.run(main())


def retries(caplog) -> int:
    return sum(RETRIED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["whole", "stream"])
def test_a_reused_connection_closed_before_the_answer_is_retried_once_on_a_new_one(how, caplog):
    """Two connections sit idle in the pool; the server closes each without answering when the next request
    reaches it (a keep-alive timer firing as the request arrives). The request is sent again on a new
    connection, not on the other pooled one, which the server would close too."""
    both_open = asyncio.Event()

    async def script(c, r):
        if r == 0 and c < 2:  # the first two requests are answered together: two connections in the pool
            if c == 1:
                both_open.set()
            await asyncio.wait_for(both_open.wait(), 5)
            return OK_ANSWER, False
        return (b"", True) if c < 2 else (OK_ANSWER, False)

    async def main():
        async with scripted_server(script) as (url, got):
            client = BackendClient(url)
            try:
                await asyncio.gather(send(client, "whole"), send(client, "whole"))
                return await send(client, how), got
            finally:
                await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.send.backend_client"):
        content, got = asyncio.run(main())
    assert content == b"{}"
    assert len(got) == 4 and got[-1] == (2, 0)  # the two first, the one closed, the one sent again on a third
    assert retries(caplog) == 1


@pytest.mark.parametrize("how", ["whole", "stream"])
def test_a_new_connection_closed_before_the_answer_is_not_retried(how, caplog):
    """The backend read the request on a connection opened for it, then closed it: it may be generating."""
    async def script(c, r):
        return b"", True

    error, got = unreachable(script, how, caplog)
    assert got == [(0, 0)] and not error.answer_started
    assert retries(caplog) == 0


@pytest.mark.parametrize("how", ["whole", "stream"])
def test_a_reused_connection_whose_answer_began_is_not_retried(how, caplog):
    """The status line came back on a pooled connection, then the connection closed: the answer had begun."""
    async def script(c, r):
        return (OK_ANSWER, False) if r == 0 else (b"HTTP/1.1 200 OK\r\n", True)

    error, got = unreachable(script, how, caplog, pooled=True)
    assert got == [(0, 0), (0, 1)] and error.answer_started
    assert retries(caplog) == 0


def test_a_get_aiohttp_sent_again_itself_is_judged_by_its_last_connection(caplog):
    """aiohttp sends an idempotent request again itself when a pooled connection closes on it; when that
    second send, on a new connection, is closed unanswered too, the backend may be working on it: no retry."""
    async def script(c, r):
        return (OK_ANSWER, False) if (c, r) == (0, 0) or c > 1 else (b"", True)

    async def main():
        async with scripted_server(script) as (url, got):
            client = BackendClient(url)
            try:
                await client.request("GET", "/v1/models")
                with pytest.raises(BackendUnreachable):
                    await client.request("GET", "/v1/models")
                return got
            finally:
                await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.send.backend_client"):
        got = asyncio.run(main())
    assert got == [(0, 0), (0, 1), (1, 0)] and retries(caplog) == 0
