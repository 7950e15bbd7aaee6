"""The backend client's connection handling against a local server: keep-alive reuse (the proxy's
latency depends on it), a finished stream returning its connection, an abandoned stream closing
its own (how vLLM learns to abort), errors translated at the boundary, and the one retry of a request
the backend certainly did not receive (never of one it may have started)."""

import asyncio
import logging
import socket

import pytest
from aiohttp import web

from moe_cohort.proxy.backend_client import BackendClient
from moe_cohort.proxy.http.errors import BackendStatusError, BackendUnreachable
from tests.proxy.servers import answer, local_backend


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


def test_refused_connect_is_retried_exactly_once_then_unreachable(caplog):
    from moe_cohort.proxy.vllm_server import free_port

    async def main():
        client = BackendClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
        try:
            with pytest.raises(BackendUnreachable) as exc:
                await client.request("POST", "/v1/completions", json={"prompt": "x"})
            return exc.value
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="moe_cohort.proxy.backend_client"):
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

    with caplog.at_level(logging.WARNING, logger="moe_cohort.proxy.backend_client"):
        asyncio.run(main())
    assert received == [b'{"prompt": "x"}', b'{"prompt": "y"}']  # each request reached the backend once
    assert not any(RETRY_LOG in r.getMessage() for r in caplog.records)


def test_a_refused_connect_succeeds_when_the_backend_comes_up_before_the_retry():
    """The port starts listening (the kernel queues the retry's connection) as the retry is logged; the
    server then answers it: the caller gets the answer, not a 502."""
    from moe_cohort.proxy.vllm_server import free_port

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
    logging.getLogger("moe_cohort.proxy.backend_client").addHandler(handler)
    try:
        assert asyncio.run(main()) == b'{"path": "/v1/completions"}'
    finally:
        logging.getLogger("moe_cohort.proxy.backend_client").removeHandler(handler)
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
