"""Online admission: requests take the backend's slots in the order that keeps the resident experts few.

vLLM keeps up to max_num_seqs requests resident and replaces a finished one at once; reordering
can only act while requests wait for a slot. So the proxy holds at most `max_in_flight` requests
(the backend's max_num_seqs) at the backend, and when a slot frees it admits, from one waiting
pool, the request expected to add the fewest experts per step to those in flight
(`encoder.waiting.WaitingPool`: fairness bound `max_queue_s` first, FCFS for requests without a
profile). When a slot is free nobody waits: there is nothing to reorder.

Each request's expert profile is predicted once, on arrival, by a `Profiler` (encoder embedding
-> profile head, in one worker thread, batched with whatever else arrived meanwhile, off the
event loop). The admission carries the profile in compact form, which the proxy forwards as
`vllm_xargs.moe_profile`, so an engine with our scheduler (`backend.scheduler`) can reorder its
own queue too. Background work (the Batch API's jobs) shares the slots through
`admit_background()` but only gets one that no waiting request wants. Nothing here knows HTTP: a
caller awaits `admit()`, talks to the backend, then calls `release(admission)`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from encoder.admission import ResidentExperts
from encoder.waiting import WaitingPool, resident_size

log = logging.getLogger(__name__)

# texts -> per text (vector, compact profile or None) or None; the vector is a flat predicted
# profile [L*E] (with a profile head) or a unit embedding [D] (nearest-embedding admission)
PredictFn = Callable[[Sequence[str]], list]


@dataclass(frozen=True, eq=False)
class Admission:
    admission_id: str  # the admission's sequence number (X-Cohort-Admission)
    queue_s: float
    profile: list[int] | None = None  # compact, for vllm_xargs.moe_profile
    flat: np.ndarray | None = field(default=None, repr=False)  # [L*E] or [D], what the resident set holds


class Profiler:
    """Predicted profiles of texts, one worker thread, batched with whatever arrived meanwhile."""

    def __init__(self, predict: PredictFn, seconds=None) -> None:
        self.predict, self.seconds = predict, seconds  # seconds: a Histogram of batch times, or None
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, "cohort-profile")

    async def profile(self, text: str):
        future = asyncio.get_running_loop().create_future()
        self._pending.append((text, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            start = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.predict, [t for t, _ in batch])
            except Exception:  # a failing encoder must not lose requests: they go without a profile (FCFS)
                log.exception("predicting the profiles of %d requests failed; admitting them first come, first served", len(batch))
                results = [None] * len(batch)
            if self.seconds is not None:
                self.seconds.observe(time.perf_counter() - start)
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Ticket:
    arrived: float
    profile: tuple | None  # (flat [L*E], compact) or None
    future: asyncio.Future


@dataclass
class AdmissionGate:
    profiler: Profiler | None
    metrics: object  # proxy.metrics.ProxyMetrics
    # size -> the resident set: ResidentExperts over predicted profiles, or ResidentEmbedding
    resident_factory: Callable[[int], object] = lambda size: ResidentExperts(1, size)
    max_in_flight: int = 256
    max_queue_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _pool: WaitingPool = field(default_factory=WaitingPool)  # waiting tickets (the keys) and their vectors
    _background: list = field(default_factory=list)  # futures of waiting background requests
    _resident: object = None
    _in_flight: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    async def admit(self, text: str, policy: str = "") -> Admission:
        """Wait until this request's turn at the backend; the caller must `release()` it afterwards."""
        arrived = self.clock()
        self.metrics.waiting.inc()
        try:
            profile = await self.profiler.profile(text) if self.profiler is not None else None
        except asyncio.CancelledError:
            self.metrics.waiting.dec()
            raise
        ticket = _Ticket(arrived, profile, asyncio.get_running_loop().create_future())
        self._pool.add(ticket, None if profile is None else profile[0], arrived)
        self._pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise

    async def admit_background(self) -> None:
        """Wait for a slot that no waiting request wants; the caller must `release()` afterwards."""
        future = asyncio.get_running_loop().create_future()
        self._background.append(future)
        self._pump()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted, but the waiter was cancelled before it could use the slot
            else:
                future.cancel()
            raise

    def release(self, admission: Admission | None = None) -> None:
        """Free the slot of an admitted request (answered, failed or abandoned)."""
        self._in_flight -= 1
        if admission is not None and admission.flat is not None and resident_size(self._resident) == admission.flat.shape[0]:
            self._resident.release(admission.flat)
        self.metrics.in_flight.set(self._in_flight)
        self._pump()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()

    def _pump(self) -> None:
        while self._in_flight < self.max_in_flight and len(self._pool):
            ticket = self._pool.pick(self._resident_for(self._pool.size), self.clock(), self.max_queue_s)
            self._pool.remove(ticket)
            if ticket.future.done():  # its waiter was cancelled and has not run its cleanup yet
                self.metrics.waiting.dec()
                continue
            self._grant(ticket)
        while self._in_flight < self.max_in_flight and self._background:
            future = self._background.pop(0)
            if not future.done():  # else cancelled while waiting
                self._take_slot()
                future.set_result(None)

    def _resident_for(self, size: int | None):
        if size is None:
            return None
        if self._resident is None or resident_size(self._resident) != size:
            self._resident = self.resident_factory(size)  # the first vector seen
        return self._resident

    def _grant(self, ticket: _Ticket) -> None:
        self._take_slot()
        queue_s = self.clock() - ticket.arrived
        flat, compact = ticket.profile if ticket.profile is not None else (None, None)
        if flat is not None and flat.shape[0] == self._pool.size:
            self._resident_for(flat.shape[0]).admit(flat)
        else:
            flat = None  # not in the resident set, so release must not remove it
        self.metrics.waiting.dec()
        self.metrics.queue_seconds.observe(queue_s)
        ticket.future.set_result(Admission(f"a{next(self._ids)}", queue_s, compact, flat))

    def _take_slot(self) -> None:
        self._in_flight += 1
        self.metrics.in_flight.set(self._in_flight)

    def _cancel(self, ticket: _Ticket) -> None:
        if ticket in self._pool:
            self._pool.remove(ticket)
            self.metrics.waiting.dec()
        elif ticket.future.done() and not ticket.future.cancelled():
            self.release(ticket.future.result())  # granted, but the waiter left before using the slot
