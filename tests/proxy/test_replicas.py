"""moe_cohort.proxy.replicas.ReplicaSet against throwaway local servers: capacity, affinity, failover only when a
replica is down and nothing of the answer came back, health checks, no replica left, and merged /v1/models."""

import asyncio
import contextlib
import socket

import numpy as np
import pytest

from moe_cohort.proxy.backend_client import BackendClient
from moe_cohort.proxy.http.errors import BackendUnreachable
from moe_cohort.proxy.replicas import ReplicaSet
from tests.proxy.servers import answer, drop, local_backend

A, B = np.array([1.0, 1.0, 0, 0]), np.array([0, 0, 1.0, 1.0])


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


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def unused(n: int) -> list[BackendClient]:
    return [BackendClient(refused_url()) for _ in range(n)]


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


def test_each_replica_holds_its_capacity_and_a_freed_slot_takes_the_next_waiter():
    async def main():
        replicas = ReplicaSet(unused(2), [1, 2], "least-loaded")
        held = [await replicas.acquire() for _ in range(3)]
        assert sorted(lease.replica for lease in held) == [0, 1, 1]
        first, second = (asyncio.create_task(replicas.acquire()) for _ in range(2))
        await settle()
        assert not first.done() and not second.done()
        first.cancel()  # a waiter that leaves gives up its turn
        await settle()
        replicas.release(held[0])
        assert (await second).replica == held[0].replica

    asyncio.run(main())


def test_affinity_gives_a_freed_slot_to_the_waiting_request_that_fits_that_replica():
    async def main():
        replicas = ReplicaSet(unused(2), [2, 2], "affinity")
        on_a, on_b = await replicas.acquire(A), await replicas.acquire(B)
        assert (on_a.replica, on_b.replica) == (0, 1)
        assert [(await replicas.acquire(v)).replica for v in (A, B)] == [0, 1]  # slots free: nobody waits
        like_a = asyncio.create_task(replicas.acquire(A * 0.9))  # older
        like_b = asyncio.create_task(replicas.acquire(B * 0.9))
        await settle()
        replicas.release(on_b)
        assert (await like_b).replica == 1 and not like_a.done()  # the B-like one, though A-like waited longer
        replicas.release(on_a)
        assert (await like_a).replica == 0

    asyncio.run(main())


def test_a_refused_replica_is_taken_out_and_the_request_goes_to_another():
    seen: list = []

    async def main():
        async with local_backend(named("b", seen)) as live:
            replicas = ReplicaSet([BackendClient(refused_url()), BackendClient(live)], [1, 1], "least-loaded")
            try:
                replica, got = await replicas.request("POST", "/v1/completions", json={"prompt": "x"})
                assert (replica, got.content) == (1, b'{"replica": "b"}')
                assert replicas.router.healthy.tolist() == [False, True]
                assert (await replicas.request("POST", "/v1/completions", json={}))[0] == 1
            finally:
                await replicas.close()

    asyncio.run(main())
    assert seen == [("b", "/v1/completions")] * 2


def test_a_request_a_live_replica_dropped_is_never_resent():
    seen: list = []

    async def main():
        async with local_backend(alive_but_dropping(seen)) as dropping, local_backend(named("b", seen)) as live:
            replicas = ReplicaSet([BackendClient(dropping), BackendClient(live)], [1, 1], "least-loaded")
            try:
                with pytest.raises(BackendUnreachable):
                    await replicas.request("POST", "/v1/completions", json={"prompt": "x"})
                assert replicas.router.healthy.tolist() == [True, True] and replicas.router.busy.tolist() == [0, 0]
            finally:
                await replicas.close()

    asyncio.run(main())
    # the replica that took the request still answers its health check, so it may be generating: the client
    # gets the error, b nothing
    assert seen == [("dropping", "/v1/completions")]


def test_a_replica_killed_with_the_request_in_hand_is_taken_out_at_once_and_the_request_goes_to_another():
    seen: list = []

    async def main():
        async with dying_server() as (dead, got), local_backend(named("b", seen)) as live:
            replicas = ReplicaSet([BackendClient(dead), BackendClient(live)], [1, 1], "least-loaded",
                                  health_timeout_s=60.0)  # no probe interval: only the failure takes it out
            try:
                replica, answered = await replicas.request("POST", "/v1/completions", json={"prompt": "x"})
                assert (replica, answered.content) == (1, b'{"replica": "b"}')
                assert len(got) == 1 and got[0].startswith(b"POST /v1/completions")  # the dead one had it
                assert replicas.router.healthy.tolist() == [False, True]  # out at once, not at the next check
                assert (await replicas.request("POST", "/v1/completions", json={}))[0] == 1
            finally:
                await replicas.close()

    asyncio.run(main())
    assert seen == [("b", "/v1/completions")] * 2


def test_an_answer_that_had_begun_is_never_resent_even_when_its_replica_is_dead():
    seen: list = []

    async def main():
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial"
        async with dying_server(head) as (dead, got), local_backend(named("b", seen)) as live:
            replicas = ReplicaSet([BackendClient(dead), BackendClient(live)], [1, 1], "least-loaded")
            try:
                with pytest.raises(BackendUnreachable) as caught:
                    await replicas.request("POST", "/v1/completions", json={"prompt": "x"})
                assert caught.value.answer_started and len(got) == 1
                assert replicas.router.busy.tolist() == [0, 0]
            finally:
                await replicas.close()

    asyncio.run(main())
    assert seen == []


def test_health_checks_take_a_replica_out_and_back():
    seen: list = []
    health = {"down": True}

    async def main():
        async with local_backend(named("a", seen, health)) as a, local_backend(named("b", seen)) as b:
            replicas = ReplicaSet([BackendClient(a), BackendClient(b)], [4, 1], "least-loaded")
            try:
                assert await replicas.check() == [False, True]
                assert (await replicas.acquire()).replica == 1  # a has more free slots but is out
                health["down"] = False
                assert await replicas.check() == [True, True]
                assert (await replicas.acquire()).replica == 0
            finally:
                await replicas.close()

    asyncio.run(main())


def test_with_no_replica_left_waiting_and_new_requests_fail_at_once():
    async def main():
        replicas = ReplicaSet(unused(1), [1], "affinity")
        await replicas.acquire(A)
        waiter = asyncio.create_task(replicas.acquire(B))
        await settle()
        replicas.set_healthy(0, False)
        with pytest.raises(BackendUnreachable, match="no healthy backend replica"):
            await asyncio.wait_for(waiter, 30)  # a guard against hanging, not a timing
        with pytest.raises(BackendUnreachable, match="no healthy backend replica"):
            await asyncio.wait_for(replicas.acquire(A), 30)

    asyncio.run(main())


def test_models_merges_the_replicas_lists_by_id():
    seen: list = []

    async def main():
        async with local_backend(named("a", seen)) as a, local_backend(named("b", seen)) as b:
            replicas = ReplicaSet([BackendClient(a), BackendClient(b), BackendClient(refused_url())], [1, 1, 1])
            replicas.set_healthy(2, False)
            try:
                return await replicas.models()
            finally:
                await replicas.close()

    merged = asyncio.run(main())
    assert merged["object"] == "list"
    assert [(m["id"], m.get("owned_by")) for m in merged["data"]] == [("m-a", None), ("shared", "a"), ("m-b", None)]


def test_one_capacity_per_backend():
    with pytest.raises(ValueError, match="one capacity per backend"):
        ReplicaSet(unused(2), [1])
