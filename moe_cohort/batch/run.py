"""Run a validated Batch file against the backend: `run_batch`, the one entry of `cohort batch run`, the
Batch API's jobs and benchmarks/bench_batch.py.

1. lines the journal already has are finished: they are neither planned nor sent again;
2. invalid lines (when skipped) go to the error file first, once;
3. the remaining requests are sent with at most `max_in_flight` at the backend (its max_num_seqs, plus a short
   queue vLLM refills a freed slot from: send/autoconfig.plan_batch); a slot that frees goes at once to the
   waiting request that best fits the requests out now (batch/order.py: admission by the predictor's
   expert profiles, predicted once for the whole file, or file order without a predictor), so the backend stays
   full and its resident set stays alike. With `config.probe` (one backend, no gate) the profiles are the
   engine's own routing of each prompt (batch/probe.py), probed while the lines go, never ahead of the
   first; a line goes without a profile only when no probed line waits. Otherwise, while nothing
   can be predicted yet (the encoder loading, or no head while one is learned) the run sends a sample drawn
   from across the file, learns from its answers, then
   hands over to admission (batch/follow.py); with `learning` (send/learning/learning.py) each later head
   re-predicts the requests next in line (which of these: batch/admission_mode.py, worked out once). With
   `config.forward_profiles` each request carries its predicted profile, for moe-cohort's scheduler in vLLM to
   choose among the queued ones by. With `gate` (the proxy's online admission, send/gate.py) each request also
   takes a background slot, so batch work only uses backend capacity that interactive requests leave free, on the
   replica the gate gives the slot on (`cohort serve` with several --backend); with `seat` (the Batch API's
   batches) each also holds one of the slots all running batches share, handed out round-robin over tenants
   (proxy/batch/share.py);
4. retries, backoff and what fails a request: batch/core.py decides; an unreachable backend
   (after the retries) stops the run with RunAborted, and a rerun resumes;
5. finished requests are committed to the journal (batch/journal.py) in groups by one writer.

The decisions are BatchCore's; here is only the I/O, in one asyncio.TaskGroup: a dispatcher that asks
the core for the next request whenever a slot frees, one task per request out (send; on Retry, sleep
and send again), and one journal writer fed by a queue. The run ends when every request is committed,
when `stop` is set or the core says the deadline passed (requests out are abandoned, so the backend
aborts them; what finished is committed), or on RunAborted (after committing what finished).

Prompts are user data: nothing here logs request text or bodies, only custom_ids and counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from moe_cohort.batch.admission_mode import admission_mode
from moe_cohort.batch.core import (Abort, Answered, BatchCore, Outcome, Retry, RunConfig, RunStats, Send, Stop, TimedOut,
                                   Unreachable, left_to_run)
from moe_cohort.batch.format import BatchFile, BatchRequest
from moe_cohort.batch.journal import Journal, JournalError, Record
from moe_cohort.encoder.plans import chunk, write_plan_file
from moe_cohort.send.auth import bearer
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendStatusError, BackendTimeout, BackendUnreachable
from moe_cohort.send.engine_counters import DecodeCounters, fetch_counters
from moe_cohort.send.gate import AdmissionGate, OneBackend
from moe_cohort.send.learning.learning import Learning
from moe_cohort.send.lifecycle import Lifecycle
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.profiles import Predictor

log = logging.getLogger(__name__)

ProgressFn = Callable[[RunStats], None]


class Seat(Protocol):
    """One of the slots the running batches of a server share (proxy/batch/share.py): taken before each
    request, given back when it is finished."""

    async def acquire(self) -> None: ...

    def release(self) -> None: ...


class RunAborted(RuntimeError):
    """The run stopped before every request finished (backend unreachable, journal write failed)."""


class Stopped(Exception):
    """Raised in a task group to end it: `stop` was set, or the deadline passed (asyncio's documented way
    to terminate a TaskGroup); what finished is kept."""


class _Unreachable(Exception):
    """The backend stayed unreachable through a request's retries."""


async def run_batch(batch: BatchFile, journal: Journal, replicas: Sequence[BackendClient],
                    predictor: Predictor | Awaitable[Predictor] | None,
                    config: RunConfig, *, skip_invalid: bool = True, on_progress: ProgressFn | None = None,
                    stop: asyncio.Event | None = None, gate: AdmissionGate | None = None,
                    deadline: float | None = None, clock: Callable[[], float] = time.time,
                    seat: Seat | None = None, learning: Learning | None = None) -> RunStats:
    """Finish every line of `batch` that `journal` has not: invalid ones into the error file (`skip_invalid`),
    the rest sent in admission order (`predictor`: send/profiles.py, or an awaitable of one still loading; None:
    file order; until it can predict, a sample: batch/follow.py). Returns when all are committed, `stop` is set, or `clock()` reaches
    `deadline`; raises RunAborted when the backend stays unreachable or the journal cannot be written.
    `seat` (proxy/batch/share.py): each request also holds one of the slots the running batches share.
    `learning` (send/learning/learning.py, with `predictor` made to read its head): the run learns from its answers."""
    if gate is None and len(replicas) != 1:
        raise ValueError(f"without the proxy's gate a run sends to one backend, got {len(replicas)}")
    pending, stats = left_to_run(batch, journal, skip_invalid)
    if not pending:
        return stats
    core = BatchCore(pending, config, stats, deadline=deadline)
    sender = _Sender(core, journal, replicas, gate, on_progress or (lambda stats: None), clock, seat, learning)
    background = asyncio.to_thread if learning is None else learning.in_background
    mode = await admission_mode(core, pending, predictor, config, probe_client=replicas[0] if gate is None else None,
                                headers=sender.headers, learning=learning, background=background,
                                seed=len(batch.requests))
    core.order, sender.follow = mode.order, mode.follow
    log.info("%d requests to send, %d at a time, in %s", len(pending), config.max_in_flight, mode.description)
    if learning is not None:
        await learning.ask_served()  # the first requests are marked when the backend counts experts
    return await sender.run(stop or asyncio.Event())


def write_plan(path: str | Path, requests: Sequence[BatchRequest], max_in_flight: int) -> None:
    """`requests` in sending order as a plan file (encoder.plans; batch k = the k-th `max_in_flight` sent);
    `id` is the custom_id, so `cohort eval --plan` reads it. Extra fields: custom_id, line, policy."""
    plan = chunk(np.arange(len(requests)), max_in_flight)
    write_plan_file(path, plan, [r.custom_id for r in requests],
                    [{"custom_id": r.custom_id, "line": r.line, "policy": r.policy} for r in requests])


class _Sender:
    def __init__(self, core: BatchCore, journal: Journal, replicas: Sequence[BackendClient], gate: AdmissionGate | None,
                 on_progress: ProgressFn, clock: Callable[[], float], seat: Seat | None,
                 learning: Learning | None = None) -> None:
        self.core, self.journal, self.replicas, self.seat = core, journal, replicas, seat
        # without the proxy's gate, the one backend's slots are this run's alone: the core counts them
        self.gate = gate or OneBackend(replicas[0], Metrics())
        self.learning = learning
        self.follow: Callable[[], Awaitable[None]] | None = None  # runs beside the sends (follow_heads)
        self.on_progress, self.clock = on_progress, clock
        self.headers = bearer(core.config.api_key)
        self.records: asyncio.Queue[Record | None] = asyncio.Queue()  # None: no more
        self.slot_freed = asyncio.Condition()

    async def run(self, stop: asyncio.Event) -> RunStats:
        counters0 = await fetch_counters(self.replicas) if self.core.config.metrics_interval_s > 0 else None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._write())
                unreachable = await self._send_all(stop, counters0)
                self.records.put_nowait(None)
        except* (JournalError, OSError) as group:  # disk full, ...: the journal rolled its files back
            raise RunAborted(f"cannot write the results: {_first(group)}") from _first(group)
        if counters0 is not None:
            await self._read_counters(counters0)
        if unreachable is not None:
            log.error("stopping the batch run: %s", unreachable)
            raise RunAborted(unreachable)
        return self.core.stats

    async def _send_all(self, stop: asyncio.Event, counters0: DecodeCounters | None) -> str | None:
        """Send until the core says stop; None, or why the backend is unreachable."""
        unreachable = None
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(raise_when_set(stop))]
                if counters0 is not None:
                    helpers.append(tg.create_task(self._watch_counters(counters0)))
                if self.follow is not None:
                    helpers.append(tg.create_task(self.follow()))
                async with asyncio.TaskGroup() as senders:
                    await self._dispatch(senders)
                for task in helpers:
                    task.cancel()
        except* Stopped:
            pass
        except* _Unreachable as group:
            unreachable = str(_first(group))
        return unreachable

    async def _dispatch(self, senders: asyncio.TaskGroup) -> None:
        while True:
            async with self.slot_freed:
                step = await self.slot_freed.wait_for(lambda: self.core.schedule(self.clock()))
            if step is Stop.DONE:
                return
            if step is Stop.EXPIRED:
                log.warning("the batch's deadline passed; stopping it")
                raise Stopped()
            if self.seat is None:
                senders.create_task(self._finish(step))
                continue
            await self.seat.acquire()  # this batch's turn at the shared slots; held until the request is finished
            try:
                task = senders.create_task(self._finish(step))
            except BaseException:
                self.seat.release()
                raise
            task.add_done_callback(lambda _: self.seat.release())  # also when cancelled before it ran

    async def _finish(self, send: Send) -> None:
        """Send one request until the core finishes it; its record goes to the writer."""
        decision = self.core.on_outcome(send, await self._slotted(send))
        while isinstance(decision, Retry):
            log.warning("custom_id %r: %s; retry %d/%d in %.1f s", send.request.custom_id, decision.reason,
                        self.core.attempts[send.request.line], self.core.config.max_retries, decision.delay_s)
            await asyncio.sleep(decision.delay_s)
            decision = self.core.on_outcome(send, await self._slotted(send))
        if isinstance(decision, Abort):
            raise _Unreachable(decision.message)
        self.records.put_nowait(decision.record)
        async with self.slot_freed:
            self.slot_freed.notify()

    async def _slotted(self, send: Send) -> Outcome:
        """One attempt on a background slot (held for the attempt only), as the core's Outcome: the gate's
        replica, and another one when that one is down and never got the request (send/lifecycle.py)."""
        headers = {**self.headers, "x-request-id": send.request_id}
        profile = self.core.order.compact(send.request.line) if self.core.config.forward_profiles else None
        life = Lifecycle(self.gate, send.request.url, send.request.body, send.request.text, headers,
                         learning=self.learning, background=True, profile=profile)
        try:
            async with life:
                answer = await life.answer()
                return Answered(answer.status_code, _decode(life.observed(answer.content)))
        except BackendStatusError as exc:
            return Answered(exc.status_code, _decode(exc.content))
        except BackendTimeout as exc:
            return TimedOut(exc.message)
        except BackendUnreachable as exc:  # no healthy replica, or down with the request in hand
            return Unreachable(exc.message)

    async def _write(self) -> None:
        """The one journal writer: what finished while a commit was on disk goes together in the next one."""
        while True:
            records = [await self.records.get()]
            while not self.records.empty():
                records.append(self.records.get_nowait())
            last = None in records
            records = [r for r in records if r is not None]
            if records:
                await asyncio.to_thread(self.journal.commit, records)
                self.core.committed(records)
                self.on_progress(self.core.stats)
            if last:
                return

    async def _watch_counters(self, start: DecodeCounters) -> None:
        while True:
            await asyncio.sleep(self.core.config.metrics_interval_s)
            await self._read_counters(start)

    async def _read_counters(self, start: DecodeCounters) -> None:
        """The replicas' decode counters since `start` into the stats (kept as they were when one cannot be read)."""
        now = await fetch_counters(self.replicas)
        if now is not None:
            self.core.stats.decode = now - start
            self.on_progress(self.core.stats)


async def raise_when_set(event: asyncio.Event) -> None:
    """A task that ends its TaskGroup with Stopped once `event` is set (cancel it when the group's work is done)."""
    await event.wait()
    raise Stopped()


def _first(error: BaseException) -> BaseException:
    """The first leaf of a (nested) exception group: task groups inside task groups nest them."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _decode(content: bytes):
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", errors="replace")
