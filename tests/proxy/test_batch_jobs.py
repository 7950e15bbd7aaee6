"""Batch API jobs against a slow local backend: the completion window (expiry mid-run and after a
restart). Runs with real vLLM are in test_batch_api.py."""

import asyncio
import json
import time

from proxy.backend import BackendClient
from proxy.batch_jobs import BatchJobs
from proxy.batchfile import read_batch_file
from proxy.planning import arrival_batches
from proxy.settings import Settings
from tests.proxy.servers import answer, local_backend

OK = {"id": "cmpl", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


async def slow(request):
    await asyncio.sleep(0.25)
    return answer(OK)


def add_batch(jobs: BatchJobs, n: int, **record) -> str:
    """An uploaded input file of `n` completions and a batch record over it (as a restart finds it)."""
    path = jobs.store.upload_path("file-in")
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "tiny", "prompt": f"p{i}"}}) + "\n" for i in range(n)))
    jobs.store.add_file("file-in", "in.jsonl", "batch", path, path.stat().st_size)
    parsed = read_batch_file(path, default_policy="topk", max_line_bytes=10_000)
    jobs.store.add_batch({"id": "batch_1", "endpoint": "/v1/completions", "input_file_id": "file-in",
                          "completion_window": "24h", "created_at": int(time.time()), "total": n,
                          "input_sha256": parsed.sha256, "input_bytes": parsed.size, **record})
    return "batch_1"


def run_until_closed(tmp_path, n: int, **record) -> tuple[dict, list[dict], list[dict]]:
    """Resume the batch with a proxy's jobs; (final record, output lines, error lines)."""
    async def main():
        async with local_backend(slow) as url:
            settings = Settings(backend_url=url, encoder="none", data_dir=str(tmp_path), batch_size=1)
            backend = BackendClient(url)
            jobs = BatchJobs(settings, backend, arrival_batches)
            batch_id = add_batch(jobs, n, **record)
            try:
                await jobs.resume()
                deadline = time.monotonic() + 20
                while (row := jobs.get(batch_id))["status"] not in ("completed", "expired", "failed", "cancelled"):
                    assert time.monotonic() < deadline, row["status"]
                    await asyncio.sleep(0.05)
                files = [jobs.store.get_file(row[f]) if row[f] else None for f in ("output_file_id", "error_file_id")]
            finally:
                await jobs.close()
                await backend.close()
        return row, *[[json.loads(x) for x in open(f["path"])] if f else [] for f in files]

    return asyncio.run(main())


def test_batch_expires_mid_run_keeping_what_finished(tmp_path):
    row, out, err = run_until_closed(tmp_path, 12, status="validating", expires_at=int(time.time()) + 2)
    assert row["status"] == "expired" and row["expired_at"] is not None
    assert 1 <= len(out) < 12 and len(out) + len(err) == 12  # 0.25 s per request, one at a time: 3 s of work, 1-2 s left
    assert {r["custom_id"] for r in out} | {r["custom_id"] for r in err} == {f"r{i}" for i in range(12)}
    assert all(r["error"]["code"] == "batch_expired" and r["response"] is None for r in err)
    assert (row["completed"], row["failed"]) == (len(out), len(err))


def test_batch_found_past_its_window_after_a_restart_expires_at_once(tmp_path):
    row, out, err = run_until_closed(tmp_path, 3, status="in_progress", expires_at=int(time.time()) - 60)
    assert row["status"] == "expired" and out == [] and row["output_file_id"] is None
    assert [r["custom_id"] for r in err] == ["r0", "r1", "r2"]
    assert err[0]["error"]["message"] == "This request could not be executed before the completion window expired."


def test_batch_inside_its_window_completes(tmp_path):
    row, out, err = run_until_closed(tmp_path, 3, status="validating", expires_at=int(time.time()) + 3600)
    assert row["status"] == "completed" and row["expired_at"] is None and len(out) == 3 and err == []
