"""Batch API jobs against a local backend, with an injected clock: the completion window (expiry mid-run
and after a restart), a restart mid-run (exactly once, usage summed over both runs), and the table of
status changes. Runs with real vLLM and the official client are in test_batch_api.py."""

import asyncio
import json

import pytest

from moe_cohort.batch.format import read_batch_file
from moe_cohort.proxy.batch.job import InvalidTransition, Job
from moe_cohort.proxy.batch.jobs import BatchJobs
from moe_cohort.proxy.batch.store import BatchStore
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.settings import Settings
from tests.helpers.vllm_stub import answer, body_of, local_backend

OK = {"id": "cmpl", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
START = 1_800_000_000.0


class Clock:
    """Epoch seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def add_batch(jobs: BatchJobs, n: int, batch_id: str = "batch_1", **record) -> str:
    """An uploaded input file of `n` completions and a batch record over it (as a restart finds it)."""
    path = jobs.store.upload_path("file-in")
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "tiny", "prompt": f"p{i}"}}) + "\n" for i in range(n)))
    jobs.store.add_file("file-in", "in.jsonl", "batch", path, path.stat().st_size, owner="")
    parsed = read_batch_file(path, default_policy="topk", max_line_bytes=10_000)
    jobs.store.add_batch({"id": batch_id, "endpoint": "/v1/completions", "input_file_id": "file-in",
                          "completion_window": "24h", "created_at": int(START), "total": n,
                          "input_sha256": parsed.sha256, "input_bytes": parsed.size, **record})
    return batch_id


def make_jobs(tmp_path, url: str, clock: Clock) -> tuple[BatchJobs, BackendClient]:
    settings = Settings(backends=(url,), encoder="none", data_dir=str(tmp_path), batch_max_in_flight=1)  # one at a time
    backend = BackendClient(url)
    return BatchJobs(settings, [backend], None, clock=clock), backend


def outcome(jobs: BatchJobs, batch_id: str) -> tuple[dict, list[dict], list[dict]]:
    row = jobs.get(batch_id, None)
    files = [jobs.store.get_file(row[f], None) if row[f] else None for f in ("output_file_id", "error_file_id")]
    return row, *[[json.loads(x) for x in open(f["path"])] if f else [] for f in files]


def run_until_closed(tmp_path, n: int, handler, clock: Clock, **record) -> tuple[dict, list[dict], list[dict]]:
    """Resume the batch with a proxy's jobs and wait for its job to end; (record, output lines, error lines)."""
    async def main():
        async with local_backend(handler) as url:
            jobs, backend = make_jobs(tmp_path, url, clock)
            batch_id = add_batch(jobs, n, **record)
            try:
                await jobs.resume()
                await jobs.join(batch_id)
                return outcome(jobs, batch_id)
            finally:
                await jobs.close()
                await backend.close()

    return asyncio.run(main())


def test_batch_expires_mid_run_keeping_what_finished(tmp_path):
    clock, sent = Clock(), []

    async def backend(request):
        sent.append((await body_of(request))["prompt"])
        if len(sent) == 3:
            clock.now += 120  # the window closes while the third request is at the backend
        return answer(OK)

    row, out, err = run_until_closed(tmp_path, 12, backend, clock, status="validating", expires_at=int(START) + 60)
    assert row["status"] == "expired" and row["expired_at"] is not None
    assert sent == ["p0", "p1", "p2"]  # nothing is sent once the window has closed
    assert [r["custom_id"] for r in out] == ["r0", "r1", "r2"]  # what finished is kept
    assert sorted(r["custom_id"] for r in err) == sorted(f"r{i}" for i in range(3, 12))
    assert all(r["error"]["code"] == "batch_expired" and r["response"] is None for r in err)
    assert (row["completed"], row["failed"]) == (3, 9) and row["usage"]["output_tokens"] == 6


def test_batch_found_past_its_window_after_a_restart_expires_at_once(tmp_path):
    sent = []

    async def backend(request):
        sent.append(request.path)
        return answer(OK)

    row, out, err = run_until_closed(tmp_path, 3, backend, Clock(), status="in_progress", expires_at=int(START) - 60)
    assert row["status"] == "expired" and out == [] and row["output_file_id"] is None and sent == []
    assert [r["custom_id"] for r in err] == ["r0", "r1", "r2"]
    assert err[0]["error"]["message"] == "This request could not be executed before the completion window expired."


def test_batch_inside_its_window_completes_with_its_usage(tmp_path):
    async def backend(request):
        return answer(OK)

    row, out, err = run_until_closed(tmp_path, 3, backend, Clock(), status="validating", expires_at=int(START) + 3600)
    assert row["status"] == "completed" and row["expired_at"] is None and len(out) == 3 and err == []
    assert (row["usage"]["input_tokens"], row["usage"]["output_tokens"], row["usage"]["total_tokens"]) == (9, 6, 15)


def test_shutdown_mid_run_then_resume_finishes_each_request_once_and_sums_usage(tmp_path):
    clock, reached, sent = Clock(), asyncio.Event(), []

    async def hangs_at_the_fifth(request):
        sent.append((await body_of(request))["prompt"])
        if len(sent) == 5:
            reached.set()
            await asyncio.Event().wait()  # never answers: the proxy shuts down meanwhile
        return answer(OK)

    async def first_run():
        async with local_backend(hangs_at_the_fifth) as url:
            jobs, backend = make_jobs(tmp_path, url, clock)
            batch_id = add_batch(jobs, 8, status="in_progress", expires_at=int(START) + 3600)
            await jobs.resume()
            await reached.wait()
            await jobs.close()  # what a proxy does at shutdown
            await backend.close()
            return BatchStore(tmp_path).get_batch(batch_id, None)

    stopped = asyncio.run(first_run())
    assert stopped["status"] == "in_progress" and stopped["completed"] == 4
    sent.clear()
    row, out, err = run_until_closed_again(tmp_path, clock, sent)
    assert row["status"] == "completed" and (row["completed"], row["failed"]) == (8, 0) and err == []
    assert sent == [f"p{i}" for i in range(4, 8)]  # the four finished before were not sent again
    assert sorted(r["custom_id"] for r in out) == [f"r{i}" for i in range(8)]
    assert row["usage"]["output_tokens"] == 16  # both runs' usage


def run_until_closed_again(tmp_path, clock: Clock, sent: list) -> tuple[dict, list[dict], list[dict]]:
    async def backend(request):
        sent.append((await body_of(request))["prompt"])
        return answer(OK)

    async def main():
        async with local_backend(backend) as url:
            jobs, client = make_jobs(tmp_path, url, clock)
            try:
                await jobs.resume()
                await jobs.join("batch_1")
                return outcome(jobs, "batch_1")
            finally:
                await jobs.close()
                await client.close()

    return asyncio.run(main())


def test_a_batch_cancelled_while_waiting_for_its_turn_is_cancelled_at_once(tmp_path):
    clock, reached, release = Clock(), asyncio.Event(), asyncio.Event()

    async def slow_first(request):
        reached.set()
        await release.wait()  # the first batch holds the turn until the test lets it go
        return answer(OK)

    async def main():
        async with local_backend(slow_first) as url:
            jobs, backend = make_jobs(tmp_path, url, clock)
            first = add_batch(jobs, 2, "batch_1", status="in_progress", expires_at=int(START) + 3600)
            second = add_batch(jobs, 2, "batch_2", status="in_progress", expires_at=int(START) + 3600)
            try:
                await jobs.resume()
                await reached.wait()  # batch_1 runs (it has the one slot); batch_2 waits for it
                assert jobs.cancel(second, "")["status"] == "cancelling"
                await asyncio.wait_for(jobs.join(second), 10)  # not after batch_1
                waiting = outcome(jobs, second)[0], jobs.get(first, None)["status"]
                release.set()
                await jobs.join(first)
                return waiting, jobs.get(first, None)["status"]
            finally:
                await jobs.close()
                await backend.close()

    (cancelled, first_then), first_at_end = asyncio.run(main())
    assert cancelled["status"] == "cancelled" and cancelled["completed"] == 0 and first_then == "in_progress"
    assert first_at_end == "completed"


def test_status_changes_follow_the_table():
    job = Job("batch_x", "validating", "/v1/completions", "file-x")
    assert job.move("in_progress") == "validating" and job.move("cancelling") == "in_progress"
    with pytest.raises(InvalidTransition, match="cancelling -> completed"):
        job.move("completed")
    assert job.move("cancelled") == "cancelling"
    with pytest.raises(InvalidTransition):
        job.move("in_progress")  # a final status is final
