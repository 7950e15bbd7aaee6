"""The Batch API's jobs: validate, wait for the backend, run, finalize; resumed after a restart.

Life of a batch (statuses are the OpenAI Batch statuses, kept in proxy/batch_store.py):

    validating ─┬─> failed                          a bad line fails the batch: errors name the lines
                └─> in_progress ──> finalizing ──> completed
    validating / in_progress ──> cancelling ──> cancelled     (partial results kept)
    validating / in_progress ──> finalizing ──> expired       (past expires_at: the unfinished
                                                               requests go to the error file as
                                                               batch_expired, results kept)

Every batch is one asyncio task (`_job`). Batches run one at a time (`_turn`), because two files
dispatched together would mix their planned batches at the backend. Running is
`proxy.batch_runner.execute` with a journal in the batch's folder, the same code as `cohort batch
run`: a restarted proxy calls `_job` again for every batch still validating, in_progress,
finalizing or cancelling, and the journal skips what was finished. While the backend is
unreachable a batch stays in_progress and retries with backoff. With `gate` (the proxy's
dispatcher) a batch's requests use only backend slots that online requests leave free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from proxy.batch_runner import RunAborted, RunConfig, acquire_unless, execute
from proxy.batch_store import ACTIVE, BatchStore
from proxy.batchfile import URLS, BatchFile, failure_line, new_id, read_batch_file
from proxy.errors import InvalidRequest, NotFound
from proxy.journal import Journal, JournalPaths, Record
from proxy.settings import Settings

log = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 100  # validation errors stored on a failed batch
RETRY_S = (5.0, 300.0)  # first and longest pause while the backend is unreachable
EXPIRED = "This request could not be executed before the completion window expired."


class BatchJobs:
    def __init__(self, settings: Settings, backend, plan_fn, gate=None) -> None:
        self.settings, self.backend, self.plan_fn = settings, backend, plan_fn  # backend: BackendClient
        self.gate = gate  # proxy.batcher.Batcher
        self._store: BatchStore | None = None
        self._turn = asyncio.Lock()
        self._cancels: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._expiring: set[str] = set()
        self._parsed: dict[str, BatchFile] = {}  # validated files, kept until their run starts

    @property
    def store(self) -> BatchStore:
        """Opened on first use, so a proxy that never sees a batch never creates its folder."""
        if self._store is None:
            self._store = BatchStore(self.settings.data_path)
        return self._store

    async def resume(self) -> None:
        """Pick up every batch that was not finished when the proxy stopped."""
        if self._store is None and not BatchStore.exists(self.settings.data_path):
            return
        for row in self.store.active_batches():
            log.info("resuming batch %s (%s, %d/%d done)", row["id"], row["status"], row["completed"] + row["failed"],
                     row["total"])
            self._start(row["id"])

    async def close(self) -> None:
        """Stop every job where it is (records and journals stay; `resume` continues them)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None:
            self._store.close()

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        file = self.store.get_file(input_file_id)
        if file is None or file["purpose"] != "batch":
            raise InvalidRequest(f"no file {input_file_id!r} with purpose 'batch'; upload one with "
                                 f"POST /v1/files (purpose=batch) first", param="input_file_id")
        now = int(time.time())
        row = self.store.add_batch({
            "id": new_id("batch_"), "status": "validating", "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": completion_window, "created_at": now, "expires_at": now + 24 * 3600,
            "metadata": metadata})
        self._start(row["id"])
        return row

    def delete_file(self, file_id: str) -> None:
        """Delete an uploaded or result file, unless an unfinished batch still reads it."""
        if self.store.get_file(file_id) is None:
            raise NotFound(f"no file {file_id!r}", param="file_id")
        readers = self.store.active_batches_reading(file_id)
        if readers:
            raise InvalidRequest(f"file {file_id} is the input of unfinished batch {', '.join(readers)}; cancel it "
                                 f"(POST /v1/batches/{{id}}/cancel) or let it finish, then delete the file",
                                 param="file_id")
        self.store.delete_file(file_id)

    def get(self, batch_id: str) -> dict:
        row = self.store.get_batch(batch_id)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return row

    def cancel(self, batch_id: str) -> dict:
        row = self.get(batch_id)
        if row["status"] in ("cancelling", "cancelled"):
            return row
        if not self.store.transition(batch_id, ("validating", "in_progress"), "cancelling"):
            raise InvalidRequest(f"batch {batch_id} is {self.get(batch_id)['status']}; only validating or "
                                 f"in_progress batches can be cancelled", param="batch_id")
        if batch_id in self._cancels:
            self._cancels[batch_id].set()
        else:  # no job runs it (an app started without its lifespan, so resume() never ran)
            self._start(batch_id)
        return self.get(batch_id)

    def _start(self, batch_id: str) -> None:
        self._cancels[batch_id] = asyncio.Event()
        loop = asyncio.get_running_loop()
        expires_at = self.get(batch_id)["expires_at"]
        if expires_at is not None:
            self._deadlines[batch_id] = loop.call_later(max(0.0, expires_at - time.time()), self._expire, batch_id)
        task = loop.create_task(self._job(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda t: self._forget(batch_id, t))

    def _expire(self, batch_id: str) -> None:
        """The completion window has passed: stop the batch where it is (see `_close_expired`)."""
        if self.get(batch_id)["status"] in ("validating", "in_progress"):
            log.warning("batch %s expired (completion window passed); stopping it", batch_id)
            self._expiring.add(batch_id)
            self._cancels[batch_id].set()

    def _forget(self, batch_id: str, task: asyncio.Task) -> None:
        if batch_id in self._deadlines:
            self._deadlines.pop(batch_id).cancel()
        self._expiring.discard(batch_id)
        self._tasks.pop(batch_id, None)
        self._cancels.pop(batch_id, None)
        self._parsed.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: job failed", batch_id, exc_info=task.exception())

    async def _job(self, batch_id: str) -> None:
        cancel = self._cancels[batch_id]
        try:
            if self.get(batch_id)["status"] == "validating":
                await self._validate(batch_id)
            in_progress = self.get(batch_id)["status"] == "in_progress"
            if in_progress and await acquire_unless(self._turn.acquire(), self._turn.release, cancel):
                try:
                    await self._run(batch_id, cancel)
                finally:
                    self._turn.release()
            if batch_id in self._expiring and self.get(batch_id)["status"] == "in_progress":
                await self._close_expired(batch_id)
            if self.get(batch_id)["status"] in ("finalizing", "cancelling"):
                await self._finalize(batch_id)
        except Exception as exc:  # a bug or a changed input file: fail the batch visibly, never leave it hanging
            log.exception("batch %s failed", batch_id)
            self.store.transition(batch_id, ACTIVE, "failed",
                                  errors=[{"code": "internal_error", "line": None, "message": str(exc), "param": None}])

    async def _validate(self, batch_id: str) -> None:
        parsed = await self._read(self.get(batch_id))
        if parsed.errors or not parsed.requests:
            errors = [{"code": "invalid_request", "line": e.line, "message": e.message, "param": None}
                      for e in parsed.errors[:MAX_ERRORS_KEPT]] or \
                     [{"code": "empty_file", "line": None, "message": "the input file has no requests", "param": None}]
            self.store.transition(batch_id, ("validating",), "failed", errors=errors)
            log.info("batch %s failed validation: %d invalid line(s)", batch_id, len(parsed.errors))
            return
        if self.store.transition(batch_id, ("validating",), "in_progress", total=len(parsed.requests),
                                 input_sha256=parsed.sha256, input_bytes=parsed.size):
            self._parsed[batch_id] = parsed

    async def _run(self, batch_id: str, cancel: asyncio.Event) -> None:
        row = self.get(batch_id)
        parsed = self._parsed.pop(batch_id, None) or await self._reread(row)
        journal = await asyncio.to_thread(Journal.open, self._paths(batch_id), _meta(row))
        try:
            await self._execute(batch_id, parsed, journal, cancel)
        finally:
            journal.close()
        if not cancel.is_set():
            self.store.transition(batch_id, ("in_progress",), "finalizing")

    async def _close_expired(self, batch_id: str) -> None:
        """Every request the journal has not finished goes to the error file as batch_expired."""
        row = self.get(batch_id)
        parsed = self._parsed.pop(batch_id, None) or await self._reread(row)
        journal = await asyncio.to_thread(Journal.open, self._paths(batch_id), _meta(row))
        try:
            journal.commit([Record(r.line, "errors", failure_line(r.custom_id, "batch_expired", EXPIRED))
                            for r in parsed.requests if r.line not in journal.done])
        finally:
            journal.close()
        self.store.transition(batch_id, ("in_progress",), "finalizing", expired_at=int(time.time()))

    async def _execute(self, batch_id: str, parsed: BatchFile, journal: Journal, cancel: asyncio.Event) -> None:
        config = RunConfig(batch_size=self.settings.batch_size, concurrency=self.settings.batch_in_flight,
                           max_retries=self.settings.batch_max_retries, metrics_interval_s=0)
        headers = {"authorization": f"Bearer {self.settings.backend_api_key}"} if self.settings.backend_api_key else {}

        def counts(stats) -> None:
            self.store.update(batch_id, completed=journal.counts["output"], failed=journal.counts["errors"])

        pause = RETRY_S[0]
        while True:
            try:
                await execute(parsed, journal, self.backend, self.plan_fn, config, skip_invalid=False,
                              headers=headers, on_progress=counts, cancel=cancel, gate=self.gate)
                return
            except RunAborted as exc:
                log.warning("batch %s paused: %s; retrying in %.0f s", batch_id, exc, pause)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cancel.wait(), pause)
            if cancel.is_set():
                return
            pause = min(pause * 2, RETRY_S[1])

    async def _read(self, row: dict) -> BatchFile:
        """The batch's input file, parsed and validated (lines must use the batch's endpoint)."""
        path = self.store.get_file(row["input_file_id"])["path"]
        return await asyncio.to_thread(read_batch_file, path, default_policy=self.settings.default_policy,
                                       max_line_bytes=self.settings.max_body_bytes,
                                       urls={row["endpoint"]: URLS[row["endpoint"]]})

    async def _reread(self, row: dict) -> BatchFile:
        """The input file again (after a restart); it must still be the file that was validated."""
        parsed = await self._read(row)
        if parsed.sha256 != row["input_sha256"]:
            raise RuntimeError(f"the input file {row['input_file_id']} of batch {row['id']} changed on disk")
        return parsed

    async def _finalize(self, batch_id: str) -> None:
        """Register the output and error files and close the batch: completed, cancelled when it was
        cancelling, expired when `_close_expired` stamped it."""
        row = self.get(batch_id)
        final = "cancelled" if row["status"] == "cancelling" else "expired" if row["expired_at"] else "completed"
        fields = {"output_file_id": None, "error_file_id": None, "usage": None}
        if row["input_sha256"]:  # validated: a journal may exist; opening it recovers a crash's torn tail
            journal = await asyncio.to_thread(Journal.open, self._paths(batch_id), _meta(row))
            journal.close()
            fields = await asyncio.to_thread(self._register_results, batch_id, journal.paths)
            fields.update(completed=journal.counts["output"], failed=journal.counts["errors"])
        self.store.transition(batch_id, (row["status"],), final, **fields)
        log.info("batch %s %s", batch_id, final)

    def _register_results(self, batch_id: str, paths: JournalPaths) -> dict:
        fields = {}
        for kind, path, field in (("output", paths.output, "output_file_id"), ("error", paths.errors, "error_file_id")):
            size = path.stat().st_size
            file_id = f"file-{kind}-{batch_id.removeprefix('batch_')}"
            if size:
                self.store.add_file(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", path, size)
            fields[field] = file_id if size else None
        fields["usage"] = _usage(paths.output)
        return fields

    def _paths(self, batch_id: str) -> JournalPaths:
        folder = self.store.batch_dir(batch_id)
        return JournalPaths(folder / "output.jsonl", folder / "errors.jsonl", folder / "output.jsonl.journal")


def _meta(row: dict) -> dict:
    return {"input_sha256": row["input_sha256"], "input_bytes": row["input_bytes"]}


def _usage(output) -> dict:
    """BatchUsage summed over the answered requests' `usage`."""
    prompt = completion = 0
    with open(output, encoding="utf-8") as f:
        for line in f:
            body = json.loads(line)["response"]["body"]
            usage = body.get("usage") if isinstance(body, dict) else None
            if isinstance(usage, dict):
                prompt += int(usage.get("prompt_tokens") or 0)
                completion += int(usage.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}

