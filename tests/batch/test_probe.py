"""Probing each line's prompt through the engine (batch/probe.py) and admitting by that routing (order.ExpertOrder, filled as profiles arrive):
the order against a brute-force replay, work conservation while no profile is known, and whole runs against a
stand-in vLLM that counts experts as our plugin does (prompt tokens routed by the prompt's topic)."""

import asyncio
import json

import numpy as np
import pytest

from moe_cohort.admission.wire import OBSERVE_KEY, Prediction
from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.order import AS_PROFILES_ARRIVE, ExpertOrder, sending_order
from moe_cohort.batch.probe import PROBE_CONCURRENCY, Probes
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.traces.observed import from_routed_experts
from tests.helpers.batch_files import parsed
from tests.helpers.batch_run import run
from tests.helpers.brute_force import brute_force_order
from tests.helpers.probe_routing import EXPERTS, PROMPT_TOKENS, TOPICS, routing_of
from tests.helpers.vllm_stub import answer, body_of, local_backend


def counting_engine(bodies: list, fail_probes: bool = False, latency_s: float = 0.01, at_once: list | None = None):
    """A stand-in vLLM: completions answered after `latency_s` per generated token (a probe is one), the bodies
    recorded in order of arrival, the expert counts of marked requests handed over at /v1/cohort/observed;
    `fail_probes`: one-token requests get a 500; `at_once`: [now, most] one-token requests at the engine at once."""
    done, at_once = {}, [0, 0] if at_once is None else at_once

    async def handler(request):
        body = await body_of(request)
        if request.path == "/v1/cohort/observed":
            return answer({"observed": {t: done.pop(t) for t in body["tokens"] if t in done}})
        bodies.append(body)
        if fail_probes and body.get("max_tokens") == 1:
            return answer({"error": {"message": "boom"}}, 500)
        generated = body.get("max_tokens", 2)
        at_once[0] += generated == 1
        at_once[1] = max(at_once)
        try:
            await asyncio.sleep(latency_s * generated)
        finally:
            at_once[0] -= generated == 1
        token = body.get("vllm_xargs", {}).get(OBSERVE_KEY)
        if token:
            done[token] = from_routed_experts(routing_of(body["prompt"], generated), PROMPT_TOKENS, EXPERTS).to_wire()
        return answer({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                       "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": generated,
                                 "total_tokens": PROMPT_TOKENS + generated}})
    return handler


def test_with_every_profile_known_probed_admission_matches_brute_force(tmp_path):
    rng = np.random.default_rng(7)
    for trial in range(10):
        vectors = [rng.random(6) * (rng.random(6) < 0.4) for _ in range(9)]
        requests = parsed(tmp_path, [f"p{i}" for i in range(9)])
        order = ExpertOrder(3, fill=AS_PROFILES_ARRIVE)
        order.predicted({r.line: Prediction(v.astype(np.float32)) for r, v in zip(requests, vectors)})
        got = [requests.index(r) for r in sending_order(requests, order, max_in_flight=3)]
        assert got == brute_force_order(vectors, 3), trial


def test_lines_without_a_profile_go_at_once_from_the_far_end_and_profiled_lines_go_first(tmp_path):
    requests = parsed(tmp_path, [f"p{i}" for i in range(6)])
    order, waiting = ExpertOrder(2, fill=AS_PROFILES_ARRIVE), list(requests)

    def send():
        request = waiting.pop(order.pick(waiting))
        order.sent(request)
        return request

    first, second = send(), send()  # nothing probed yet: no slot waits for a probe
    assert (first.text, second.text) == ("p5", "p4")
    order.predicted({requests[1].line: Prediction(np.array([1.0, 0.0], np.float32))})
    order.finished(first)
    assert send().text == "p1"  # a profiled line before any line without one
    order.finished(second)
    assert send().text == "p3"  # none profiled waits: the far end again


def test_a_profile_that_comes_for_a_line_out_counts_as_resident_until_it_finishes(tmp_path):
    requests = parsed(tmp_path, ["a", "b", "c"])
    order, waiting = ExpertOrder(3, fill=AS_PROFILES_ARRIVE), list(requests)
    out = waiting.pop(order.pick(waiting))
    order.sent(out)
    assert order.out(out.line) and not order.out(requests[0].line)
    order.predicted({out.line: Prediction(np.array([1.0, 0.0], np.float32))})
    assert order.router.placed[out.line][1] is not None  # in the resident set the next choice is scored against
    order.finished(out)
    order.predicted({out.line: Prediction(np.array([0.0, 1.0], np.float32))})  # too late: dropped
    assert out.line not in order.router.pool and order.router.waiting() == 0 and order.out(out.line)


def _file(tmp_path, prompts, max_tokens=8):
    from moe_cohort.batch.format import read_batch_file

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "tiny", "prompt": p, "max_tokens": max_tokens}}) + "\n"
                            for i, p in enumerate(prompts)))
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000)


def _run(tmp_path, batch, handler, config):
    stats, paths = run(tmp_path, batch, handler, config)
    return stats, [json.loads(x)["custom_id"] for x in paths.output.read_text().splitlines()]


PROBING = RunConfig(max_in_flight=3, metrics_interval_s=0, probe=True)


def test_a_probing_run_sends_its_first_lines_at_once_probes_one_at_a_time_and_groups_lines_of_one_topic(tmp_path):
    topics = list(TOPICS)
    prompts = [f"{topics[i % 3]} question {i}" for i in range(48)]  # the topics interleaved in the file
    bodies, at_once = [], [0, 0]
    engine = counting_engine(bodies, latency_s=0.002, at_once=at_once)  # a line of 32 tokens, a probe of one
    stats, answered = _run(tmp_path, _file(tmp_path, prompts, max_tokens=32), engine, PROBING)
    assert sorted(answered) == sorted(f"c{i}" for i in range(48)) and stats.failed == 0  # every line once
    probes = [b["prompt"] for b in bodies if b["max_tokens"] == 1]
    lines = [b["prompt"] for b in bodies if b["max_tokens"] == 32]
    assert len(probes) == len(set(probes)) == stats.probed and stats.probed >= 40  # each at most once
    assert all(OBSERVE_KEY in b["vllm_xargs"] for b in bodies if b["max_tokens"] == 1)
    assert at_once[1] == PROBE_CONCURRENCY  # never more probes at the engine, taking slots from lines
    assert sorted(lines[:3]) == sorted(prompts[45:])  # no barrier: the far end of the file goes at once
    assert not set(lines[:3]) & set(probes)  # lines out are not probed
    # in file order the topic changes at every line (44 times); here lines of one topic fill the slots together (the
    # stand-in ends the 3 out at once, and then the next round starts afresh: about 3 of a topic in a row)
    sent = [p.split()[0] for p in lines[3:]]
    assert sum(a != b for a, b in zip(sent, sent[1:])) <= len(sent) // 2, " ".join(sent)


def test_a_failing_probe_leaves_its_line_to_go_without_a_profile(tmp_path):
    bodies = []
    prompts = [f"chess question {i}" for i in range(10)]
    stats, answered = _run(tmp_path, _file(tmp_path, prompts), counting_engine(bodies, fail_probes=True), PROBING)
    assert sorted(answered) == sorted(f"c{i}" for i in range(10)) and stats.failed == 0 and stats.succeeded == 10
    assert stats.probed == 0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_probes_run_at_most_concurrency_at_once_and_skip_lines_sent(tmp_path, concurrency):
    batch = _file(tmp_path, [f"python question {i}" for i in range(8)])
    found, now, most = {}, [0], [0]
    engine = counting_engine([], latency_s=0.02)

    async def slow(request):
        if request.path != "/v1/completions":
            return await engine(request)
        now[0] += 1
        most[0] = max(most[0], now[0])
        try:
            return await engine(request)
        finally:
            now[0] -= 1

    async def main():
        async with local_backend(slow) as url:
            backend = BackendClient(url, timeout_s=5)
            try:
                probes = Probes(backend, concurrency, lambda line, p: found.setdefault(line, p))
                await probes.run(batch.requests, sent=lambda line: line in (1, 8))
            finally:
                await backend.close()
    asyncio.run(main())
    assert most[0] == concurrency
    assert set(found) == {r.line for r in batch.requests} - {1, 8}


def test_once_a_probe_finds_no_backend_no_more_are_sent(tmp_path):
    from moe_cohort.embedded.vllm_server import free_port

    batch = _file(tmp_path, [f"chess question {i}" for i in range(40)])
    calls = []

    class Counting(BackendClient):
        async def request(self, method, path, **kwargs):
            calls.append(path)
            return await super().request(method, path, **kwargs)

    async def main():
        client = Counting(f"http://127.0.0.1:{free_port('127.0.0.1')}", connect_timeout_s=1)
        try:
            probes = Probes(client, 2, lambda line, p: None)
            await probes.run(batch.requests, sent=lambda line: False)
            return probes
        finally:
            await client.close()
    probes = asyncio.run(main())
    assert probes.unreachable and calls.count("/v1/completions") <= 3  # those already out when the first failed


def test_probes_wait_for_room_and_go_on_when_there_is(tmp_path):
    batch = _file(tmp_path, [f"cooking question {i}" for i in range(6)])
    bodies, found, opened = [], {}, []
    engine = counting_engine(bodies)

    async def main():
        async with local_backend(engine) as url:
            backend = BackendClient(url, timeout_s=5)
            try:
                probes = Probes(backend, 1, lambda line, p: found.setdefault(line, p))
                task = asyncio.create_task(probes.run(batch.requests, sent=lambda line: False,
                                                      room=lambda: len(bodies) < 3 or bool(opened)))
                await asyncio.sleep(0.5)
                waited = len(bodies)
                opened.append(True)  # the run sent lines: room again
                await task
                return waited
            finally:
                await backend.close()
    assert asyncio.run(main()) == 3  # no probe while there was no room
    assert len(bodies) == 6 and set(found) == {r.line for r in batch.requests}


def test_a_backend_that_restarts_mid_probe_costs_no_line(tmp_path):
    """The backend goes away once its first probes came, and is back 0.3 s later on the same port: the probes stop
    (no backend), the lines retry until it is back, and every line is answered exactly once, none failed."""
    from dataclasses import replace

    from aiohttp.test_utils import RawTestServer

    from moe_cohort.batch.journal import Journal, JournalPaths
    from moe_cohort.batch.run import run_batch
    from moe_cohort.embedded.vllm_server import free_port

    topics = list(TOPICS)
    batch = _file(tmp_path, [f"{topics[i % 3]} question {i}" for i in range(24)], max_tokens=16)
    bodies, port = [], free_port("127.0.0.1")
    engine = counting_engine(bodies, latency_s=0.005)
    config = replace(PROBING, max_retries=30, backoff_s=0.02, max_backoff_s=0.1)
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")

    async def restarted(first: RawTestServer) -> RawTestServer:
        while sum(b["max_tokens"] == 1 for b in bodies) < 3:
            await asyncio.sleep(0.001)
        await first.close()  # mid-probe: lines and a probe out
        await asyncio.sleep(0.3)
        second = RawTestServer(engine, host="127.0.0.1", port=port)
        await second.start_server()
        return second

    async def main():
        first = RawTestServer(engine, host="127.0.0.1", port=port)
        await first.start_server()
        backend = BackendClient(f"http://127.0.0.1:{port}", timeout_s=1.0, connect_timeout_s=0.2)
        journal = Journal.open(paths, batch.journal_meta)
        restart = asyncio.create_task(restarted(first))
        try:
            return await run_batch(batch, journal, [backend], None, config)
        finally:
            journal.close()
            await backend.close()
            await (await restart).close()

    stats = asyncio.run(main())
    answered = [json.loads(x)["custom_id"] for x in paths.output.read_text().splitlines()]
    assert sorted(answered) == sorted(f"c{i}" for i in range(24)) and len(set(answered)) == 24
    assert stats.failed == 0 and stats.succeeded == 24
    assert not paths.errors.exists() or paths.errors.read_text() == ""
    assert 3 <= sum(b["max_tokens"] == 1 for b in bodies) < 24  # probes went, and stopped when it went away
