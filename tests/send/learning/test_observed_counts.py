"""send/learning/observed_counts.py: marking request bodies, asking the engine whether it counts experts, taking the
counts of finished requests from the replica that served them, and reading vLLM's routed_experts answers."""

import asyncio
import base64
import io
import json

import numpy as np
import pytest

import moe_cohort.send.learning.observed_counts as observed_counts
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.learning.observed_counts import (ObservedCounts, marked, one_routed_choice, routed_answer, routed_counts,
                                                      without_routed)
from moe_cohort.traces.observed import BadObservation, from_routed_experts
from tests.helpers.vllm_stub import answer, body_of, local_backend

LAYERS, EXPERTS = 2, 8
ROWS = np.array([[[7, 6], [7, 6]]] * 3 + [[[0, 1], [0, 1]]] * 2, np.uint8)  # [tokens - 1, L, k]: 3 prompt tokens


def _engine(counted: dict, asked: list, serves: bool = True):
    """A vLLM with (or without) our plugin's route: hands over `counted`'s entries once, records each ask."""
    async def handler(request):
        if request.path != observed_counts.OBSERVED_PATH or not serves:
            return answer({"detail": "Not Found"}, status=404)
        tokens = (await body_of(request))["tokens"]
        asked.append(tokens)
        return answer({"observed": {t: counted.pop(t) for t in tokens if t in counted}})
    return handler


def _counts():
    return from_routed_experts(ROWS, 3, EXPERTS)


def test_a_marked_body_keeps_the_clients_own_xargs_and_its_token_says_whether_it_is_kept():
    counts = ObservedCounts([], lambda *a: None)
    kept, live = {"vllm_xargs": {"theirs": 1}}, {}
    counts.mark(kept, True)
    counts.mark(live, False)
    assert kept["vllm_xargs"]["theirs"] == 1 and marked(kept) and marked(live) and not marked({})
    assert not kept["vllm_xargs"]["moe_observe"].endswith("-live") and live["vllm_xargs"]["moe_observe"].endswith("-live")
    assert kept["vllm_xargs"]["moe_observe"] != live["vllm_xargs"]["moe_observe"]


def test_the_counts_of_a_finished_request_reach_deliver_from_the_replica_that_served_it(monkeypatch):
    monkeypatch.setattr(observed_counts, "POLL_S", 0.01)
    delivered, asked, counted = [], [], {}

    async def main():
        async with local_backend(_engine(counted, asked)) as url:
            client = BackendClient(url, timeout_s=5)
            counts = ObservedCounts([client], lambda text, obs, kept: delivered.append((text, obs, kept)))
            await counts.ask_served()
            kept, live = {}, {}
            counts.mark(kept, True)
            counts.mark(live, False)
            for body in (kept, live):
                counted[body["vllm_xargs"]["moe_observe"]] = _counts().to_wire()  # the engine counted it
            counts.finished(client, kept, "kept text")
            counts.finished(client, live, "live text")
            counts.finished(client, {}, "never marked")
            for _ in range(200):
                if len(delivered) == 2:
                    break
                await asyncio.sleep(0.01)
            waiting = counts.waiting_on()
            counts.close()
            await client.close()
            return counts.serves, waiting

    serves, waiting = asyncio.run(main())
    assert serves is True and waiting == set()
    assert [(text, kept) for text, _, kept in delivered] == [("kept text", True), ("live text", False)]
    np.testing.assert_array_equal(delivered[0][1].decode, _counts().decode)
    assert asked[0] == []  # the probe


def test_a_backend_without_the_route_is_told_apart_and_nothing_waits_on_it(caplog):
    asked = []

    async def main():
        async with local_backend(_engine({}, asked, serves=False)) as url:
            client = BackendClient(url, timeout_s=5)
            counts = ObservedCounts([client], lambda *a: None)
            await counts.ask_served()
            counts.finished(client, {"vllm_xargs": {"moe_observe": "t"}}, "text")
            await client.close()
            return counts.serves, counts.waiting_on()

    assert asyncio.run(main()) == (False, set())
    assert "VLLM_PLUGINS=moe_cohort" in caplog.text


@pytest.mark.parametrize("plugin, serves", [((False, True), True), ((False, False), False)])
def test_every_replica_is_asked_and_the_counts_are_served_where_one_serves_them(plugin, serves):
    async def main():
        async with local_backend(_engine({}, [], serves=plugin[0])) as a, \
                local_backend(_engine({}, [], serves=plugin[1])) as b:
            clients = [BackendClient(a, timeout_s=5), BackendClient(b, timeout_s=5)]
            counts = ObservedCounts(clients, lambda *a: None)
            await counts.ask_served()
            await asyncio.gather(*(c.close() for c in clients))
            return counts.serves

    assert asyncio.run(main()) is serves


def test_bad_counts_are_lost_as_invalid_and_unclaimed_ones_expire(monkeypatch):
    monkeypatch.setattr(observed_counts, "GIVE_UP_S", 0.0)
    delivered, lost, counted = [], [], {"bad": {"prompt_tokens": "no"}}

    async def main():
        async with local_backend(_engine(counted, [])) as url:
            client = BackendClient(url, timeout_s=5)
            counts = ObservedCounts([client], lambda *a: delivered.append(a), lambda why, n: lost.append((why, n)))
            counts.serves = True
            counts.finished(client, {"vllm_xargs": {"moe_observe": "bad"}}, "text")
            counts.finished(client, {"vllm_xargs": {"moe_observe": "never-counted"}}, "text")
            await counts.flush(timeout_s=2.0)
            counts.close()
            await client.close()
            return counts.waiting_on()

    assert asyncio.run(main()) == set()
    assert delivered == [] and sorted(lost) == [("invalid", 1), ("unclaimed", 1)]


def _b64_npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_an_answer_with_routed_experts_is_read_and_stripped():
    one = {"choices": [{"index": 0, "routed_experts": _b64_npy(ROWS)}], "usage": {"prompt_tokens": 3}}
    content = json.dumps(one).encode()
    parsed = routed_answer(content)
    assert parsed == one and one_routed_choice(parsed)
    counts = routed_counts(parsed, {}, EXPERTS)
    np.testing.assert_array_equal(counts.decode, _counts().decode)
    assert counts.prompt_tokens == 3 and counts.num_experts == EXPERTS
    assert routed_counts(parsed, {}, None).num_experts == 8  # as many as the highest id needs
    assert json.loads(without_routed(parsed)) == {"choices": [{"index": 0}], "usage": {"prompt_tokens": 3}}
    assert routed_answer(b'{"choices": [{"index": 0}]}') is None and routed_answer(b'"routed_experts" [') is None
    assert not one_routed_choice({"choices": [one["choices"][0]] * 2})
    with pytest.raises(BadObservation):
        routed_counts({"choices": [{"routed_experts": _b64_npy(ROWS)}]}, {}, EXPERTS)  # no usage
    with pytest.raises(BadObservation):
        routed_counts({"choices": [{"routed_experts": "bm90IGFuIGFycmF5"}], "usage": {"prompt_tokens": 3}}, {}, EXPERTS)
