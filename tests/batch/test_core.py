"""The batch core's decisions, without sockets, sleeps or the event loop: time is passed in, jitter is a
seeded random.Random."""

import json
import random

import pytest

from moe_cohort.batch.core import (Abort, Answered, BatchCore, Finish, Retry, RunConfig, RunStats, Send, Stop, TimedOut,
                                   Unreachable, expired_records, invalid_records)
from moe_cohort.batch.format import read_batch_file

OK = {"object": "text_completion", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
CONFIG = RunConfig(max_in_flight=2, max_retries=2, backoff_s=1.0, max_backoff_s=1.5)


def requests(tmp_path, n, extra=""):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": f"p{i}"}}) + "\n" for i in range(n)) + extra)
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000)


class ListedOrder:
    """A stand-in for admission: sends the waiting request listed first; records what it is told."""

    def __init__(self, ids):
        self.rank, self.told = {cid: i for i, cid in enumerate(ids)}, []

    def pick(self, waiting):
        return min(range(len(waiting)), key=lambda i: self.rank[waiting[i].custom_id])

    def sent(self, request):
        self.told.append(("sent", request.custom_id))

    def finished(self, request):
        self.told.append(("finished", request.custom_id))


def core(tmp_path, n=4, config=CONFIG, deadline=None, order=None):
    parsed = requests(tmp_path, n)
    return BatchCore(parsed.requests, config, RunStats(total=n, finished_before=0, clock=lambda: 0.0), deadline=deadline,
                     rng=random.Random(0), order=order)


def test_hands_out_requests_in_the_orders_choice_up_to_the_concurrency(tmp_path):
    order = ListedOrder(["r3", "r1", "r0", "r2"])
    c = core(tmp_path, order=order)
    first, second = c.schedule(0.0), c.schedule(0.0)
    assert [first.request.custom_id, second.request.custom_id] == ["r3", "r1"]
    assert c.schedule(0.0) is None  # both slots taken
    assert isinstance(c.on_outcome(first, Answered(200, OK)), Finish)  # frees a slot
    third = c.schedule(0.0)
    assert third.request.custom_id == "r0" and c.schedule(0.0) is None
    c.on_outcome(second, Answered(200, OK))
    assert c.schedule(0.0).request.custom_id == "r2" and c.schedule(0.0) is Stop.DONE
    assert order.told[:4] == [("sent", "r3"), ("sent", "r1"), ("finished", "r3"), ("sent", "r0")]  # resident sets follow


def test_without_an_order_the_file_order_goes(tmp_path):
    c = core(tmp_path)
    assert [c.schedule(0.0).request.custom_id for _ in range(2)] == ["r0", "r1"]


def test_nothing_is_sent_once_the_deadline_passed(tmp_path):
    c = core(tmp_path, deadline=100.0)
    assert isinstance(c.schedule(99.9), Send)
    assert c.schedule(100.0) is Stop.EXPIRED and len(c.waiting) == 3


def test_429_and_5xx_retry_with_growing_jittered_backoff_then_fail_with_the_backends_answer(tmp_path):
    c = core(tmp_path)
    send = c.schedule(0.0)
    delays = [c.on_outcome(send, Answered(429, {"error": {"message": "slow down"}})) for _ in range(2)]
    assert [d.reason for d in delays] == ["status 429", "status 429"]
    assert 0.5 <= delays[0].delay_s <= 1.0 and 0.75 <= delays[1].delay_s <= 1.5  # 1 s, then 2 s capped at 1.5, jittered
    final = c.on_outcome(send, Answered(503, {"error": {"message": "engine overloaded", "code": 503}}))
    line = final.record.data
    assert final.record.kind == "errors" and line["error"]["message"] == "engine overloaded"
    assert line["response"]["status_code"] == 503 and line["response"]["request_id"] == send.request_id
    assert c.attempts == {}  # the slot is free


def test_other_4xx_fail_at_once_and_2xx_succeed(tmp_path):
    c = core(tmp_path)
    bad, good = c.schedule(0.0), c.schedule(0.0)
    rejected = c.on_outcome(bad, Answered(400, {"error": {"message": "prompt too long", "type": "BadRequestError"}}))
    assert rejected.record.kind == "errors" and rejected.record.data["error"]["message"] == "prompt too long"
    answered = c.on_outcome(good, Answered(200, OK))
    assert answered.record.kind == "output" and answered.record.data["response"]["body"] == OK
    assert answered.record.data["error"] is None and answered.record.data["custom_id"] == "r1"


def test_timeouts_retry_then_fail_the_request_only(tmp_path):
    c = core(tmp_path)
    send = c.schedule(0.0)
    assert isinstance(c.on_outcome(send, TimedOut("no answer")), Retry)
    assert isinstance(c.on_outcome(send, TimedOut("no answer")), Retry)
    final = c.on_outcome(send, TimedOut("no answer"))
    assert final.record.kind == "errors" and final.record.data["error"] == {"code": "backend_timeout",
                                                                            "message": "no answer"}


def test_an_unreachable_backend_after_the_retries_aborts_the_run(tmp_path):
    c = core(tmp_path)
    send = c.schedule(0.0)
    assert [type(c.on_outcome(send, Unreachable("cannot reach"))) for _ in range(3)] == [Retry, Retry, Abort]
    assert c.attempts == {}


def test_a_retry_after_success_starts_counting_anew(tmp_path):
    c = core(tmp_path, config=RunConfig(max_in_flight=1, max_retries=1, backoff_s=1.0))
    first = c.schedule(0.0)
    assert isinstance(c.on_outcome(first, Answered(500, {})), Retry)
    c.on_outcome(first, Answered(200, OK))
    second = c.schedule(0.0)
    assert isinstance(c.on_outcome(second, Answered(500, {})), Retry)  # not the first request's last attempt


def test_committed_records_count_and_sum_usage(tmp_path):
    c = core(tmp_path)
    a, b = c.schedule(0.0), c.schedule(0.0)
    records = [c.on_outcome(a, Answered(200, OK)).record, c.on_outcome(b, Answered(400, "no")).record]
    c.committed(records)
    s = c.stats
    assert (s.succeeded, s.failed, s.prompt_tokens, s.completion_tokens, s.done) == (1, 1, 3, 2, 2)


def test_invalid_and_expired_lines_become_error_records_once(tmp_path):
    parsed = requests(tmp_path, 3, extra="not json\n")
    (invalid,) = invalid_records(parsed, {})
    assert invalid.line == 4 and invalid.data["error"]["code"] == "invalid_request"
    assert invalid_records(parsed, {4: "errors"}) == []
    expired = expired_records(parsed.requests, {1: "output"})
    assert [r.data["custom_id"] for r in expired] == ["r1", "r2"]
    assert {r.data["error"]["code"] for r in expired} == {"batch_expired"}


@pytest.mark.parametrize("key, field, value", [("max_in_flight", "batch_max_in_flight", 7), ("api_key", "backend_api_key", "k"),
                                              ("max_in_flight", "max_in_flight", 9)])
def test_run_config_comes_from_the_settings(key, field, value):
    from moe_cohort.send.settings import Settings

    settings = Settings(**{field: value})
    assert getattr(RunConfig.from_settings(settings), key) == value
    assert RunConfig.from_settings(settings, metrics_interval_s=0).metrics_interval_s == 0


@pytest.mark.integration
def test_the_core_loads_no_event_loop_and_no_http_client():
    import subprocess
    import sys

    code = ("import sys, moe_cohort.batch.core; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'asyncio', 'aiohttp', 'httpx', 'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
