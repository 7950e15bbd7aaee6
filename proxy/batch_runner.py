"""Run a validated Batch file against the backend: plan up front, dispatch in plan order, journal results.

One implementation for `cohort batch run` and the proxy's Batch API (`execute`):

1. lines the journal already has are finished: they are neither planned nor sent again;
2. invalid lines (when skipped) go to the error file first, once;
3. the remaining requests are planned up front, per routing policy, with the process's plan
   function (encoder + planner, or arrival order), and sent in plan order with at most
   `concurrency` at the backend: a slot that frees goes to the next planned request at once, so
   the backend stays full and the requests running together come from one or two planned batches
   (set concurrency = the backend's max_num_seqs = batch_size); on the proxy, each request also
   takes a background slot of the online dispatcher (`gate`, proxy/batcher.py), so batch work
   only uses backend capacity that interactive requests leave free;
4. 429, 408, 5xx and timeouts are retried with exponential backoff and jitter; a request that still
   fails, or gets another 4xx, goes to the error file with the backend's message. An unreachable
   backend (after the retries) stops the run (`RunAborted`): the requests are fine, the backend is
   not, and a rerun resumes;
5. finished requests are committed to the journal in groups (proxy/journal.py), from a thread.

Prompts are user data: nothing here logs request text or bodies, only custom_ids and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import numpy as np

from encoder.plans import write_plan_file
from proxy.batchfile import BatchFile, BatchRequest, failure_line, new_id, result_line
from proxy.batcher import Batcher, PlanFn
from proxy.errors import BackendStatusError, BackendTimeout, BackendUnreachable
from proxy.expert_loads import ExpertLoads, fetch_expert_loads
from proxy.journal import Journal, Record

log = logging.getLogger(__name__)

Plan = list[list[BatchRequest]]


class RunAborted(RuntimeError):
    """The run stopped before every request finished (backend unreachable, journal write failed)."""


@dataclass(frozen=True)
class RunConfig:
    batch_size: int = 16
    concurrency: int = 16  # requests at the backend at once
    max_retries: int = 5
    backoff_s: float = 0.5  # first retry delay; doubles per attempt, up to max_backoff_s
    max_backoff_s: float = 30.0
    metrics_interval_s: float = 2.0  # how often the backend's expert-load counters are read (0: never)


@dataclass
class RunStats:
    total: int  # requests in the file (valid lines)
    finished_before: int  # requests finished by earlier runs
    started: float = field(default_factory=time.monotonic)
    succeeded: int = 0  # this run
    failed: int = 0  # this run (answered with an error, or none after the retries)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    expert_loads: ExpertLoads | None = None  # backend counters since this run started

    @property
    def done(self) -> int:
        return self.finished_before + self.succeeded + self.failed

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.elapsed, 1e-9)


ProgressFn = Callable[[RunStats], None]


def plan_requests(requests: Sequence[BatchRequest], plan_fn: PlanFn, batch_size: int) -> Plan:
    """Batches of requests in dispatch order: each routing policy planned on its own, policies in order of appearance."""
    by_policy: dict[str, list[BatchRequest]] = {}
    for r in requests:
        by_policy.setdefault(r.policy, []).append(r)
    plan: Plan = []
    for group in by_policy.values():
        for batch in plan_fn([r.text for r in group], batch_size):
            plan.append([group[int(i)] for i in batch])
    _check_plan(plan, requests)
    return plan


def _check_plan(plan: Plan, requests: Sequence[BatchRequest]) -> None:
    planned = sorted(r.line for batch in plan for r in batch)
    if planned != sorted(r.line for r in requests):
        raise RuntimeError(f"the planner returned {len(planned)} requests for {len(requests)} (lost or repeated ones)")


def write_plan(path: str | Path, plan: Plan) -> None:
    """The plan in the one plan-file format (encoder.plans), in dispatch order; `id` is the custom_id,
    so `cohort eval --plan` reads it. Extra fields: custom_id, line, policy."""
    requests = [r for batch in plan for r in batch]
    starts = np.cumsum([0] + [len(batch) for batch in plan])
    write_plan_file(path, [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])], [r.custom_id for r in requests],
                    [{"custom_id": r.custom_id, "line": r.line, "policy": r.policy} for r in requests])


async def execute(batch: BatchFile, journal: Journal, backend, plan_fn: PlanFn, config: RunConfig, *,
                  skip_invalid: bool = True, headers: dict[str, str] | None = None,
                  on_progress: ProgressFn | None = None, cancel: asyncio.Event | None = None,
                  gate: "Batcher | None" = None) -> RunStats:
    """Finish every line of `batch` that `journal` has not: invalid ones into the error file, the rest planned and sent.
    With `gate`, every request also waits for a background slot of that dispatcher."""
    if skip_invalid:
        journal.commit([Record(e.line, "errors", failure_line(e.custom_id, "invalid_request", e.message))
                        for e in batch.errors if e.line not in journal.done])
    pending = [r for r in batch.requests if r.line not in journal.done]
    stats = RunStats(total=len(batch.requests), finished_before=len(batch.requests) - len(pending))
    if not pending:
        return stats
    plan = await asyncio.to_thread(plan_requests, pending, plan_fn, config.batch_size)
    log.info("planned %d requests into %d batches of <= %d", len(pending), len(plan), config.batch_size)
    runner = BatchRunner(backend, journal, config, headers=headers, on_progress=on_progress, gate=gate)
    return await runner.run(plan, stats, cancel)


class BatchRunner:
    """Send planned requests with bounded concurrency, retry, and commit their results."""

    def __init__(self, backend, journal: Journal, config: RunConfig, *, headers: dict[str, str] | None = None,
                 on_progress: ProgressFn | None = None, gate: "Batcher | None" = None) -> None:
        self.backend, self.journal, self.config = backend, journal, config  # backend: proxy.backend.BackendClient
        self.gate = gate
        self.headers = dict(headers or {})
        self.on_progress = on_progress or (lambda stats: None)
        self._abort: BaseException | None = None

    async def run(self, plan: Plan, stats: RunStats, cancel: asyncio.Event | None = None) -> RunStats:
        """Send every request of `plan`; returns when all finished or `cancel` is set (in-flight ones are
        abandoned, so the backend aborts them). Raises RunAborted when the run had to stop."""
        loads0 = await fetch_expert_loads(self.backend) if self.config.metrics_interval_s > 0 else None
        stop = asyncio.Event()  # set by `cancel` or by an abort
        slots = asyncio.Semaphore(self.config.concurrency)
        tasks: set[asyncio.Task] = set()
        writer = _Writer(self.journal, lambda records: self._committed(records, stats), self._stopper(stop))
        helpers = [asyncio.create_task(_cancel_on(stop, tasks))]
        if cancel is not None:
            helpers.append(asyncio.create_task(_forward(cancel, stop)))
        if loads0 is not None:
            helpers.append(asyncio.create_task(self._watch_loads(stats, loads0)))
        try:
            await self._dispatch(plan, slots, tasks, writer, stop)
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await _cancel_all(tasks)
            await writer.close()
            await _cancel_all(helpers)
        if loads0 is not None:
            await self._read_loads(stats, loads0)
        if self._abort is not None:
            raise RunAborted(str(self._abort)) from self._abort
        return stats

    async def _dispatch(self, plan: Plan, slots: asyncio.Semaphore, tasks: set, writer: "_Writer",
                        stop: asyncio.Event) -> None:
        for batch in plan:
            for request in batch:
                await slots.acquire()
                if not await self._admitted(stop) or stop.is_set():
                    slots.release()
                    return
                task = asyncio.create_task(self._one(request, slots, writer, stop))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    async def _one(self, request: BatchRequest, slots: asyncio.Semaphore, writer: "_Writer", stop: asyncio.Event) -> None:
        try:
            writer.add(await self._send(request))
        except Exception as exc:  # BackendUnreachable after the retries (or a bug): stop, never drop silently
            self._stopper(stop)(exc)
        finally:
            slots.release()
            if self.gate is not None:
                self.gate.release()

    async def _admitted(self, stop: asyncio.Event) -> bool:
        """Wait for the gate's background slot; False (holding none) when `stop` comes first."""
        if self.gate is None:
            return True
        return await acquire_unless(self.gate.admit_background(), self.gate.release, stop)

    async def _send(self, request: BatchRequest) -> Record:
        """The request's result, after retries; raises BackendUnreachable when the backend stays unreachable."""
        request_id = new_id("req_")
        headers = {**self.headers, "x-request-id": request_id}
        for attempt in range(self.config.max_retries + 1):
            last = attempt == self.config.max_retries
            try:
                answer = await self.backend.request("POST", request.url, json=request.body, headers=headers)
                return Record(request.line, "output", result_line(request, request_id, answer.status_code,
                                                                  _decode(answer.content)))
            except BackendStatusError as exc:
                if last or not _retryable(exc.status_code):
                    return Record(request.line, "errors",
                                  result_line(request, request_id, exc.status_code, _decode(exc.content)))
                reason = f"status {exc.status_code}"
            except BackendTimeout as exc:
                if last:
                    return Record(request.line, "errors", failure_line(request.custom_id, "backend_timeout", exc.message))
                reason = "timeout"
            except BackendUnreachable:
                if last:
                    raise
                reason = "backend unreachable"
            delay = self._delay(attempt)
            log.warning("custom_id %r: %s; retry %d/%d in %.1f s", request.custom_id, reason, attempt + 1,
                        self.config.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _delay(self, attempt: int) -> float:
        """Exponential backoff with jitter in [50%, 100%] of the step, so retries of a batch spread out."""
        step = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** attempt)
        return step * (0.5 + random.random() / 2)

    def _committed(self, records: list[Record], stats: RunStats) -> None:
        for r in records:
            if r.kind == "errors":
                stats.failed += 1
                continue
            stats.succeeded += 1
            body = r.data["response"]["body"]
            usage = body.get("usage") if isinstance(body, dict) else None
            if isinstance(usage, dict):
                stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        self.on_progress(stats)

    def _stopper(self, stop: asyncio.Event) -> Callable[[BaseException], None]:
        def abort(exc: BaseException) -> None:
            if self._abort is None:
                self._abort = exc
                log.error("stopping the batch run: %s", exc)
            stop.set()
        return abort

    async def _watch_loads(self, stats: RunStats, start: ExpertLoads) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            await self._read_loads(stats, start)

    async def _read_loads(self, stats: RunStats, start: ExpertLoads) -> None:
        now = await fetch_expert_loads(self.backend)
        if now is not None:
            stats.expert_loads = now - start
            self.on_progress(stats)


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _decode(content: bytes):
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", errors="replace")


class _Writer:
    """Group commit: results that finish while a commit is on disk go together in the next one."""

    def __init__(self, journal: Journal, on_commit: Callable[[list[Record]], None],
                 on_error: Callable[[BaseException], None]) -> None:
        self.journal, self.on_commit, self.on_error = journal, on_commit, on_error
        self._buffer: list[Record] = []
        self._closing = False
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    def add(self, record: Record) -> None:
        self._buffer.append(record)
        self._wake.set()

    async def close(self) -> None:
        """Commit what is left, then stop."""
        self._closing = True
        self._wake.set()
        await self._task

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            records, self._buffer = self._buffer, []
            if records:
                try:
                    await asyncio.to_thread(self.journal.commit, records)
                except Exception as exc:  # disk full, ...: stop the run; the journal rolled the files back
                    self.on_error(exc)
                    return
                self.on_commit(records)
            if self._closing and not self._buffer:
                return


async def acquire_unless(acquire: Awaitable, release: Callable[[], None], event: asyncio.Event) -> bool:
    """Await `acquire` unless `event` is set first; True when it holds what it acquired (if both
    happen, it gives it back with `release` and returns False). `acquire` must undo itself when cancelled."""
    acquiring = asyncio.ensure_future(acquire)
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({acquiring, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not acquiring.done():
            acquiring.cancel()
            await asyncio.gather(acquiring, return_exceptions=True)
    held = acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None
    if held and event.is_set():
        release()
        return False
    return held


async def _forward(cancel: asyncio.Event, stop: asyncio.Event) -> None:
    await cancel.wait()
    stop.set()


async def _cancel_on(stop: asyncio.Event, tasks: set[asyncio.Task]) -> None:
    await stop.wait()
    for task in list(tasks):
        task.cancel()


async def _cancel_all(tasks) -> None:
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)
