"""The Batch API's jobs: validate, wait for the turn, run, finalize; resumed after a restart.

Life of a batch (the OpenAI Batch statuses; the table of changes is proxy/batch/job.py's):

    validating ─┬─> failed                          a bad line fails the batch: errors name the lines
                └─> in_progress ──> finalizing ──> completed
    validating / in_progress ──> cancelling ──> cancelled     (partial results kept)
    in_progress ──> finalizing ──> expired          (past expires_at: the unfinished requests go to
                                                     the error file as batch_expired, results kept)

Every batch is one asyncio task over one `Job`. Batches run at once and share the background slots
(Settings.max_in_flight_for_batches requests at the backend in all): a slot that frees goes round-robin over
tenants, then over a tenant's batches (proxy/batch/share.py), so one tenant's big batch never holds
another's small one, and no batch waits for another to finish. Within a batch, the slots it gets go
to its requests in its admission order (batch/order.py). Running is
`batch.run.run_batch` with a journal in the batch's folder, the same code as `cohort batch
run`: a restarted proxy starts a job again for every batch still validating, in_progress,
finalizing or cancelling, and the journal skips what was finished. While the backend is unreachable
a batch stays in_progress and retries with backoff. With `gate` (the proxy's dispatcher) a batch's
requests use only backend slots that online requests leave free. Cancel, expiry and shutdown all
set the job's one `stop` event; the job tells them apart by its status and `expiring`.

Usage is summed from RunStats into the record after each commit (a kill -9 in between loses those tokens).
`create`, `get` and `cancel` act for an owner (send/auth.py): another owner's batch or input file is
NotFound, as a missing one is; a batch's result files are registered to the batch's owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Callable

from moe_cohort.batch.core import RunConfig, RunStats, expired_records
from moe_cohort.batch.format import BatchFile, new_id
from moe_cohort.batch.journal import Journal
from moe_cohort.batch.run import RunAborted, run_batch
from moe_cohort.proxy.batch.folder import BatchFolder, validation_errors
from moe_cohort.proxy.batch.job import CANCELLABLE, Job
from moe_cohort.proxy.batch.share import FairShare
from moe_cohort.proxy.batch.store import BatchStore
from moe_cohort.send.autoconfig import BatchPlan
from moe_cohort.send.errors import InvalidRequest, NotFound
from moe_cohort.send.settings import Settings

log = logging.getLogger(__name__)

RETRY_S = (5.0, 300.0)  # first and longest pause while the backend is unreachable


class BatchJobs:
    def __init__(self, settings: Settings, replicas, predictor, gate=None, *, clock: Callable[[], float] = time.time,
                 learning=None) -> None:
        self.settings, self.replicas, self.predictor = settings, replicas, predictor  # [BackendClient], send.profiles.Predictor
        self.learning = learning  # send.learning.learning.Learning of `cohort serve --learn`: batches learn too
        self.gate = gate  # send.gate.AdmissionGate
        self.clock = clock  # epoch seconds: completion windows
        self.config = RunConfig.from_settings(settings, metrics_interval_s=0)
        self._store: BatchStore | None = None
        self.folder: BatchFolder | None = None  # the batches' files, with the store
        self.share = FairShare(settings.max_in_flight_for_batches)  # the batches' requests at the backend, shared fairly
        self._jobs: dict[str, tuple[Job, asyncio.Task]] = {}
        self._closing = False

    def configure(self, plan: BatchPlan) -> None:
        """Run batches as the engines' handshake says (send/autoconfig.plan_batch): lines out at once, shared by
        the running batches, and whether each carries its predicted profile."""
        self.config = replace(self.config, max_in_flight=plan.max_in_flight, forward_profiles=plan.forward_profiles)
        self.share.resize(plan.max_in_flight)

    @property
    def store(self) -> BatchStore:
        """Opened on first use, so a proxy that never sees a batch never creates its folder."""
        if self._store is None:
            self._store = BatchStore(self.settings.data_path)
            self.folder = BatchFolder(self._store, self.settings)
        return self._store

    async def resume(self) -> None:
        """Pick up every batch that was not finished when the proxy stopped."""
        if self._store is None and not BatchStore.exists(self.settings.data_path):
            return
        for row in self.store.active_batches():
            log.info("resuming batch %s (%s, %d/%d done)", row["id"], row["status"], row["completed"] + row["failed"],
                     row["total"])
            self._start(Job.from_row(row))

    async def close(self) -> None:
        """Stop every job where it is (records and journals stay; `resume` continues them)."""
        self._closing = True
        for job, _ in self._jobs.values():
            job.stop.set()
        await asyncio.gather(*(task for _, task in self._jobs.values()), return_exceptions=True)
        if self._store is not None:
            self._store.close()

    async def join(self, batch_id: str) -> None:
        """Wait until the job of `batch_id` (if one runs) has ended: final, failed, or stopped by `close`."""
        if batch_id in self._jobs:
            await asyncio.wait({self._jobs[batch_id][1]})

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict | None) -> dict:
        file = self.store.get_file(input_file_id, owner)
        if file is None:
            raise NotFound(f"no file {input_file_id!r}; upload one with POST /v1/files (purpose=batch) first",
                           param="input_file_id")
        if file["purpose"] != "batch":
            raise InvalidRequest(f"file {input_file_id!r} has purpose {file['purpose']!r}; a batch reads a file "
                                 f"uploaded with purpose 'batch'", param="input_file_id")
        now = int(self.clock())
        row = self.store.add_batch({
            "id": new_id("batch_"), "status": "validating", "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": completion_window, "created_at": now, "expires_at": now + 24 * 3600,
            "metadata": metadata, "owner": owner})
        self._start(Job.from_row(row))
        return row

    def get(self, batch_id: str, owner: str | None) -> dict:
        """The batch, if `owner` owns it (None: whoever does)."""
        row = self.store.get_batch(batch_id, owner)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return row

    def cancel(self, batch_id: str, owner: str) -> dict:
        row = self.get(batch_id, owner)  # another owner's batch: NotFound before anything else
        job = self._jobs[batch_id][0] if batch_id in self._jobs else Job.from_row(row)
        if job.status in ("cancelling", "cancelled"):
            return self.get(batch_id, owner)
        if job.status not in CANCELLABLE:
            raise InvalidRequest(f"batch {batch_id} is {job.status}; only validating or in_progress batches can be "
                                 f"cancelled", param="batch_id")
        if batch_id not in self._jobs:  # no job runs it (an app started without its lifespan: no resume())
            self._start(job)
        self._move(job, "cancelling")
        job.stop.set()
        return self.get(batch_id, owner)

    def _start(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        timer = None
        if job.expires_at is not None:
            timer = loop.call_later(max(0.0, job.expires_at - self.clock()), self._expire, job)
        task = loop.create_task(self._lifecycle(job))
        self._jobs[job.id] = (job, task)
        task.add_done_callback(lambda t: self._forget(job, timer, t))

    def _expire(self, job: Job) -> None:
        """The completion window has passed: stop the batch where it is (see `_close_expired`)."""
        if job.status in CANCELLABLE:
            log.warning("batch %s expired (completion window passed); stopping it", job.id)
            job.expiring = True
            job.stop.set()

    def _forget(self, job: Job, timer: asyncio.TimerHandle | None, task: asyncio.Task) -> None:
        if timer is not None:
            timer.cancel()
        self._jobs.pop(job.id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: job failed", job.id, exc_info=task.exception())

    def _move(self, job: Job, to: str, **fields) -> None:
        """The one way a batch changes status: the table's check (Job.move), then the record's compare-and-set."""
        before = job.move(to)
        if not self.store.transition(job.id, (before,), to, **fields):
            raise RuntimeError(f"batch {job.id} left {before} behind its job's back")

    async def _lifecycle(self, job: Job) -> None:
        try:
            if job.status == "validating":
                await self._validate(job)
            if job.status == "in_progress" and not job.expired(self.clock()):
                await self._run(job)
            if self._closing:
                return
            if job.status == "in_progress" and (job.expiring or job.expired(self.clock())):
                await self._close_expired(job)
            if job.status in ("finalizing", "cancelling"):
                await self._finalize(job)
        except Exception as exc:  # a bug or a changed input file: fail the batch visibly, never leave it hanging
            log.exception("batch %s failed", job.id)
            self._move(job, "failed", errors=[{"code": "internal_error", "line": None, "message": str(exc),
                                               "param": None}])
        finally:
            if job.journal is not None:
                job.journal.close()

    async def _validate(self, job: Job) -> None:
        parsed = await self.folder.read(job)
        if job.status != "validating":  # cancelled meanwhile
            return
        errors = validation_errors(parsed)
        if errors:
            self._move(job, "failed", errors=errors)
            log.info("batch %s failed validation: %d invalid line(s)", job.id, len(parsed.errors))
            return
        job.parsed, job.input_sha256, job.input_bytes = parsed, parsed.sha256, parsed.size
        self._move(job, "in_progress", total=len(parsed.requests), input_sha256=parsed.sha256, input_bytes=parsed.size)

    async def _run(self, job: Job) -> None:
        """Run the batch until it finished or is stopped; retries while the backend is down."""
        parsed, journal = await self.folder.parsed(job), await self.folder.journal(job)
        pause = RETRY_S[0]
        while not job.stop.is_set() and not await self._run_once(job, parsed, journal):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.stop.wait(), pause)
            pause = min(pause * 2, RETRY_S[1])
        if not job.stop.is_set() and not job.expired(self.clock()):
            self._move(job, "finalizing")

    async def _run_once(self, job: Job, parsed: BatchFile, journal: Journal) -> bool:
        """One run_batch; False when the backend was unreachable and the job should try again."""
        base = (job.prompt_tokens, job.completion_tokens)

        def progress(stats: RunStats) -> None:
            job.prompt_tokens, job.completion_tokens = base[0] + stats.prompt_tokens, base[1] + stats.completion_tokens
            self.store.update(job.id, completed=journal.counts["output"], failed=journal.counts["errors"],
                              usage=job.usage)

        try:
            await run_batch(parsed, journal, self.replicas, self.predictor, self.config, skip_invalid=False,
                            on_progress=progress, stop=job.stop, gate=self.gate, deadline=job.expires_at,
                            clock=self.clock, seat=self.share.seat(job.owner, job.id), learning=self.learning)
        except RunAborted as exc:
            log.warning("batch %s paused: %s; retrying", job.id, exc)
            return job.stop.is_set()
        return True

    async def _close_expired(self, job: Job) -> None:
        """Every request the journal has not finished goes to the error file as batch_expired."""
        parsed, journal = await self.folder.parsed(job), await self.folder.journal(job)
        await asyncio.to_thread(journal.commit, expired_records(parsed.requests, journal.done))
        job.expired_at = int(self.clock())
        self._move(job, "finalizing", expired_at=job.expired_at)

    async def _finalize(self, job: Job) -> None:
        """Register the output and error files and close the batch: cancelled when it was cancelling,
        expired when `_close_expired` stamped it, else completed."""
        final = "cancelled" if job.status == "cancelling" else "expired" if job.expired_at else "completed"
        fields = {"output_file_id": None, "error_file_id": None, "usage": None}
        if job.input_sha256:  # validated: a journal may exist; opening it recovers a crash's torn tail
            journal = await self.folder.journal(job)
            owner = self.store.get_batch(job.id, None)["owner"]
            fields.update(self.folder.register_results(job.id, journal.paths, owner), usage=job.usage,
                          completed=journal.counts["output"], failed=journal.counts["errors"])
        self._move(job, final, **fields)
        log.info("batch %s %s", job.id, final)
