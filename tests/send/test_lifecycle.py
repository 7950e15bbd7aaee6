"""moe_cohort.send.lifecycle.Lifecycle against throwaway local servers: every send path (a whole answer, a
stream, a batch line) fails over only when its replica is down and generated nothing, ends once, and frees its
slot; a live replica that dropped the request, or an answer under way, is never resent; a client that leaves
frees its slot and closes the backend connection."""

import asyncio
import json
import re

import httpx
import pytest
from aiohttp import web

from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.format import read_batch_file
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.run import run_batch
from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendUnreachable
from moe_cohort.send.gate import AdmissionGate
from moe_cohort.send.lifecycle import Lifecycle
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import ReplicaSet
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_client import CHAT, run
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import (OK_BODY, alive_but_dropping, answer, body_of, dying_server, local_backend, named,
                                     refused_url)

PATH = "/v1/completions"


def gate_of(*urls: str, health_timeout_s: float = 5.0) -> AdmissionGate:
    replicas = ReplicaSet([BackendClient(u) for u in urls], [1] * len(urls), "least-loaded",
                          health_timeout_s=health_timeout_s)
    return AdmissionGate(None, Metrics(), replicas)


def freed(gate: AdmissionGate) -> bool:
    return not gate.replicas.router.busy.any()


async def whole(gate: AdmissionGate) -> tuple[int, bytes]:
    async with Lifecycle(gate, PATH, {"prompt": "x"}, "x", {}) as life:
        answer = await life.answer()
        return life.granted.replica, answer.content


async def streamed(gate: AdmissionGate) -> tuple[int, bytes]:
    life = Lifecycle(gate, PATH, {"prompt": "x", "stream": True}, "x", {})
    try:
        await life.admit()
        response = await life.open_stream()
        return life.granted.replica, b"".join([c async for c in life.slot.client.iter_raw(response)])
    finally:
        await life.close()


async def batch_line(gate: AdmissionGate, tmp_path) -> dict:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "c0", "method": "POST", "url": PATH, "body": {"prompt": "x"}}) + "\n")
    parsed = read_batch_file(source, default_policy="topk", max_line_bytes=10_000)
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")
    journal = Journal.open(paths, parsed.journal_meta)
    try:
        stats = await run_batch(parsed, journal, gate.replicas.clients, None,
                                RunConfig(max_in_flight=1, max_retries=0, metrics_interval_s=0), gate=gate)
    finally:
        journal.close()
    assert stats.succeeded == 1
    return json.loads(paths.output.read_text())


@pytest.mark.parametrize("path", ["whole", "stream", "batch"])
def test_each_send_path_leaves_a_replica_killed_with_the_request_in_hand_for_another_once(path, tmp_path):
    seen: list = []

    async def main():
        async with dying_server() as (dead, got), local_backend(named("b", seen)) as live:
            gate = gate_of(dead, live, health_timeout_s=60.0)  # only the failure takes it out
            try:
                if path == "batch":
                    line = await batch_line(gate, tmp_path)
                    assert line["response"]["body"] == {"replica": "b"}
                else:
                    replica, content = await (whole(gate) if path == "whole" else streamed(gate))
                    assert (replica, content) == (1, b'{"replica": "b"}')
                assert len(got) == 1 and got[0].startswith(b"POST " + PATH.encode())  # the dead one had it
                assert gate.replicas.router.healthy.tolist() == [False, True]  # out at once
                assert freed(gate)
            finally:
                await gate.replicas.close()

    asyncio.run(main())
    assert seen == [("b", PATH)]  # answered once


def test_a_refused_replica_is_taken_out_and_the_request_goes_to_another():
    seen: list = []

    async def main():
        async with local_backend(named("b", seen)) as live:
            gate = gate_of(refused_url(), live)
            try:
                assert await whole(gate) == (1, b'{"replica": "b"}')
                assert gate.replicas.router.healthy.tolist() == [False, True]
                assert (await whole(gate))[0] == 1 and freed(gate)
            finally:
                await gate.replicas.close()

    asyncio.run(main())
    assert seen == [("b", PATH)] * 2


def test_a_request_a_live_replica_dropped_is_never_resent():
    seen: list = []

    async def main():
        async with local_backend(alive_but_dropping(seen)) as dropping, local_backend(named("b", seen)) as live:
            gate = gate_of(dropping, live)
            try:
                with pytest.raises(BackendUnreachable):
                    await whole(gate)
                assert gate.replicas.router.healthy.tolist() == [True, True] and freed(gate)
            finally:
                await gate.replicas.close()

    asyncio.run(main())
    # the replica that took the request still answers its health check, so it may be generating: the client
    # gets the error, b nothing
    assert seen == [("dropping", PATH)]


def test_an_answer_that_had_begun_is_never_resent_even_when_its_replica_is_dead():
    seen: list = []

    async def main():
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial"
        async with dying_server(head) as (dead, got), local_backend(named("b", seen)) as live:
            gate = gate_of(dead, live)
            try:
                with pytest.raises(BackendUnreachable) as caught:
                    await whole(gate)
                assert caught.value.answer_started and len(got) == 1 and freed(gate)
            finally:
                await gate.replicas.close()

    asyncio.run(main())
    assert seen == []


def test_a_request_cancelled_while_queued_or_at_the_backend_frees_its_slot_once():
    async def hang(request):
        await asyncio.sleep(60)

    async def main():
        async with local_backend(hang) as slow:
            gate = gate_of(slow)
            try:
                at_backend = asyncio.ensure_future(whole(gate))
                while gate.replicas.in_flight() == 0:
                    await asyncio.sleep(0.01)
                queued = asyncio.ensure_future(whole(gate))  # the one slot is taken: it waits
                await asyncio.sleep(0.05)
                for task in (queued, at_backend):
                    task.cancel()
                await asyncio.gather(queued, at_backend, return_exceptions=True)
                assert freed(gate) and gate.replicas.router.waiting() == 0
                assert gate.metrics.registry.get_sample_value("cohort_waiting") == 0
            finally:
                await gate.replicas.close()

    asyncio.run(main())


def test_non_streaming_clients_that_leave_free_their_slots_and_close_the_backend_connection():
    """One slot: A holds it at a backend that never answers, B waits for it; both clients hang up. A's backend
    connection is closed (how vLLM learns to abort), B never reaches the backend, and the slot serves C."""
    arrived, a_closed = [], asyncio.Event()

    async def backend(request):
        content = (await body_of(request))["messages"][0]["content"]
        arrived.append(content)
        if content == "c":
            return answer(OK_BODY)
        response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "1000000"})
        await response.prepare(request)
        try:
            while True:  # an answer that never ends, until the proxy hangs up
                await response.write(b" ")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            a_closed.set()
            raise

    async def send(port, content):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": content}]}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return writer

    async def until(condition):
        for _ in range(1000):
            if await condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def main():
        async with local_backend(backend) as url:
            settings = Settings(backends=(url,), port=free_port(), encoder="none", max_in_flight=1)
            with ProxyThread(settings) as proxy:
                async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
                    async def gauge(name):
                        return float(re.search(rf"^{name} (\S+)$", (await c.get("/metrics")).text, re.M).group(1))

                    a = await send(settings.port, "a")
                    await until(lambda: _true(arrived == ["a"]))
                    b = await send(settings.port, "b")
                    await until(lambda: _equal(gauge("cohort_waiting"), 1))
                    b.close()  # B leaves while it waits, then A while at the backend
                    await until(lambda: _equal(gauge("cohort_waiting"), 0))
                    a.close()
                    await asyncio.wait_for(a_closed.wait(), 10)
                    await until(lambda: _equal(gauge("cohort_in_flight"), 0))
                    third = await c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "c"}]})
        return third

    assert run(main()).status_code == 200
    assert arrived == ["a", "c"]


async def _true(value):
    return value


async def _equal(awaitable, expected):
    return await awaitable == expected
