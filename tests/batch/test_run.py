"""run_batch (the driver) against failures a real vLLM cannot produce on demand (429, 503, hangs, a dead
backend): the backend is a throwaway local server (tests/helpers/vllm_stub.py). The decisions alone, without
sockets, are in tests/batch/test_core.py; runs against real vLLM in tests/cli/test_batch.py and
tests/proxy/batch/test_api.py."""

import asyncio
import contextlib
import json
from collections import Counter

import numpy as np
import pytest

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.run import RunAborted, run_batch, write_plan
from moe_cohort.encoder.plans import read_plan_file
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.gate import AdmissionGate
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.profiles import Predictor
from moe_cohort.send.replicas import ReplicaSet
from tests.helpers.batch_files import batch_file
from tests.helpers.batch_run import CONFIG, OK, run
from tests.helpers.vllm_stub import answer, body_of, drop, local_backend


def read_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_retries_with_backoff_then_the_backends_message_goes_to_the_error_file(tmp_path):
    calls = Counter()

    async def backend(request):
        prompt = (await body_of(request))["prompt"]
        calls[prompt] += 1
        if prompt == "flaky" and calls[prompt] <= 2:
            return answer({"error": {"message": "slow down"}}, status=429)
        if prompt == "hang" and calls[prompt] == 1:
            await asyncio.sleep(2)  # past the client's 0.3 s timeout
        if prompt == "down":
            return answer({"error": {"message": "engine overloaded", "code": 503}}, status=503)
        if prompt == "bad":
            return answer({"error": {"message": "prompt too long", "type": "BadRequestError"}}, status=400)
        return answer(OK)

    stats, paths = run(tmp_path, batch_file(tmp_path, ["a", "flaky", "hang", "down", "bad", "b"]), backend)
    assert calls == {"a": 1, "b": 1, "flaky": 3, "hang": 2, "down": 4, "bad": 1}  # 503: 1 + max_retries
    out, err = read_lines(paths.output), read_lines(paths.errors)
    assert sorted(r["custom_id"] for r in out) == ["a", "b", "flaky", "hang"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    errors = {r["custom_id"]: r for r in err}
    assert errors["down"]["error"]["message"] == "engine overloaded" and errors["down"]["response"]["status_code"] == 503
    assert errors["bad"]["error"]["message"] == "prompt too long"
    assert (stats.succeeded, stats.failed, stats.completion_tokens) == (4, 2, 8)


def test_timeouts_after_all_retries_fail_the_request_only(tmp_path):
    async def backend(request):
        if (await body_of(request))["prompt"] == "slow":
            await asyncio.sleep(2)  # past the client's 0.3 s timeout
        return answer(OK)

    stats, paths = run(tmp_path, batch_file(tmp_path, ["slow", "fast"]), backend)
    (err,) = read_lines(paths.errors)
    assert err["custom_id"] == "slow" and err["response"] is None and err["error"]["code"] == "backend_timeout"
    assert [r["custom_id"] for r in read_lines(paths.output)] == ["fast"]


def test_unreachable_backend_stops_the_run_and_a_rerun_finishes_it(tmp_path):
    parsed = batch_file(tmp_path, [f"r{i}" for i in range(12)])
    state = {"up": True, "served": 0}

    async def backend(request):
        if not state["up"]:
            return drop(request)
        state["served"] += 1
        if state["served"] == 5:
            state["up"] = False  # the backend dies after 5 answers
        return answer(OK)

    with pytest.raises(RunAborted, match="cannot reach the backend"):
        run(tmp_path, parsed, backend)
    first = [r["custom_id"] for r in read_lines(tmp_path / "out.jsonl")]
    assert 1 <= len(first) <= 5 and not read_lines(tmp_path / "out.errors.jsonl")  # not the requests' fault
    state["up"] = True
    stats, paths = run(tmp_path, parsed, backend)
    ids = [r["custom_id"] for r in read_lines(paths.output)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12)) and len(ids) == len(set(ids))
    assert stats.finished_before == len(first) and stats.succeeded == 12 - len(first)


def kinds_predictor():
    """Profiles by the prompt's first letter: "a..." requests use experts 0-1, "b..." experts 2-3 ([L*E] = [4])."""
    def predict(texts):
        return [Prediction(np.array([1.0, 1.0, 0, 0]) if t.startswith("a") else np.array([0, 0, 1.0, 1.0]), [0] * 8)
                for t in texts]
    return Predictor(predict, lambda size: ResidentExperts(1, size), "profile")


def test_freed_slots_go_to_requests_like_those_out_with_bounded_concurrency(tmp_path):
    parsed = batch_file(tmp_path, ["a0", "b0", "a1", "b1", "a2", "b2"])
    order, in_flight, peak = [], [0], [0]
    a2_sent = asyncio.Event()

    async def backend(request):
        prompt = (await body_of(request))["prompt"]
        order.append(prompt)
        a2_sent.set() if prompt == "a2" else None
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        if prompt == "a1":  # a1 stays out until a2 was sent: a0's slot must go to a2, which fits a1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(a2_sent.wait(), 0.25)
        in_flight[0] -= 1
        return answer(OK)

    run(tmp_path, parsed, backend, RunConfig(max_in_flight=2, metrics_interval_s=0), kinds_predictor())
    assert order[:3] == ["a0", "a1", "a2"] and sorted(order) == sorted(r.custom_id for r in parsed.requests)
    assert peak[0] == 2  # file order would send a0 b0 a1 b1 a2 b2
    (tmp_path / "file-order").mkdir()
    plain = batch_file(tmp_path / "file-order", ["a0", "b0", "a1"])
    run(tmp_path / "file-order", plain, backend, RunConfig(max_in_flight=2, metrics_interval_s=0))
    assert order[6:] == ["a0", "b0", "a1"]  # no predictor: the file's order


def test_a_dry_run_plan_is_what_cohort_eval_reads(tmp_path):
    parsed = batch_file(tmp_path, [f"r{i}" for i in range(7)])
    sent = [parsed.requests[i] for i in (6, 0, 3, 1, 2, 5, 4)]
    write_plan(tmp_path / "plan.jsonl", sent, 3)
    read = read_plan_file(tmp_path / "plan.jsonl", [f"r{i}" for i in range(7)])  # what `cohort eval --plan` calls
    assert [b.tolist() for b in read] == [[6, 0, 3], [1, 2, 5], [4]]


def test_gate_gives_batch_work_only_the_slots_online_traffic_leaves(tmp_path):
    parsed = batch_file(tmp_path, [f"r{i}" for i in range(8)])
    in_flight, peak = [0], [0]

    async def backend(request):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.01)
        in_flight[0] -= 1
        return answer(OK)

    async def main():
        paths = JournalPaths.for_output(tmp_path / "out.jsonl")
        async with local_backend(backend) as url:
            client = BackendClient(url)
            gate = AdmissionGate(None, Metrics(), ReplicaSet([client], [3]))
            await gate.admit("online 1")  # two interactive requests hold two of the three slots
            await gate.admit("online 2")
            journal = Journal.open(paths, parsed.journal_meta)
            try:
                stats = await run_batch(parsed, journal, [client], None, CONFIG, gate=gate)
                cancel = asyncio.Event()  # now a run that cannot get a slot at all, cancelled while waiting
                await gate.admit("online 3")
                asyncio.get_running_loop().call_later(0.05, cancel.set)
                (tmp_path / "second").mkdir()
                parsed2 = batch_file(tmp_path / "second", ["s0", "s1"])
                journal2 = Journal.open(JournalPaths.for_output(tmp_path / "out2.jsonl"), parsed2.journal_meta)
                stats2 = await asyncio.wait_for(run_batch(parsed2, journal2, [client], None, CONFIG,
                                                          stop=cancel, gate=gate), 5)
                journal2.close()
            finally:
                journal.close()
                await client.close()
        return stats, stats2, gate.metrics.registry.get_sample_value("cohort_in_flight")

    stats, stats2, held = asyncio.run(main())
    assert stats.succeeded == 8 and peak[0] == 1  # CONFIG allows 3, the gate had 1 free
    assert stats2.succeeded == 0 and held == 3  # the three online requests; the batch holds none


def test_without_the_proxys_gate_a_run_sends_to_one_backend_and_counts_its_slots_once(tmp_path):
    """The core's cap is the one slot count: a 1-slot run never has two requests out, and several backends without
    a gate to route between them are refused before anything is sent."""
    parsed = batch_file(tmp_path, [f"r{i}" for i in range(6)])
    out = {"now": 0, "most": 0}

    async def backend(request):
        out["now"] += 1
        out["most"] = max(out["most"], out["now"])
        await asyncio.sleep(0.01)
        out["now"] -= 1
        return answer(OK)

    stats, _ = run(tmp_path, parsed, backend, config=RunConfig(max_in_flight=1, metrics_interval_s=0))
    assert stats.succeeded == 6 and out["most"] == 1
    journal = Journal.open(JournalPaths.for_output(tmp_path / "two.jsonl"), parsed.journal_meta)
    two = [BackendClient("http://127.0.0.1:9"), BackendClient("http://127.0.0.1:10")]
    with pytest.raises(ValueError, match="one backend"):
        asyncio.run(run_batch(parsed, journal, two, None, CONFIG))
    journal.close()
