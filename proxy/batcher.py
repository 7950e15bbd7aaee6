"""The window and the dispatcher: hold requests briefly, plan them into batches, admit them in order.

Per routing policy, requests wait in a window that flushes when `flush_size` of them wait or the
oldest has waited `max_wait_s` (size or deadline), so a lone request is never held longer than
the window. A flush plans the waiting requests (embedding + planner, in a worker thread) into
batches; the batches join one ready queue in planned order. At most `max_in_flight` requests are
admitted to the backend at once; when a slot frees, the next ready request goes, unless some
ready request has waited longer than `max_queue_s`: then the oldest of those goes first
(fairness beats the plan). Background work (the Batch API's jobs) shares the same slots through
`admit_background()` but only gets a slot that no ready request wants: interactive traffic goes
first, and together they never exceed `max_in_flight`. Nothing here knows HTTP: a caller awaits
`admit()` (or `admit_background()`), talks to the backend, then calls `release()`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from encoder.plans import arrival_plan

log = logging.getLogger(__name__)

# texts, batch size -> batches of indices into texts, in dispatch order
PlanFn = Callable[[Sequence[str], int], list[Sequence[int]]]


@dataclass(frozen=True)
class Admission:
    batch_id: str
    queue_s: float


@dataclass(eq=False)
class _Ticket:
    text: str
    policy: str
    arrived: float
    future: asyncio.Future
    state: str = "window"  # window -> planning -> ready -> admitted | cancelled
    batch_id: str = ""


@dataclass
class Batcher:
    plan_fn: PlanFn
    metrics: object  # proxy.metrics.ProxyMetrics
    batch_size: int = 16
    flush_size: int = 16
    max_wait_s: float = 0.05
    max_queue_s: float = 30.0
    max_in_flight: int = 256
    clock: Callable[[], float] = time.monotonic
    _windows: dict[str, list[_Ticket]] = field(default_factory=dict)
    _ready: deque = field(default_factory=deque)
    _background: deque = field(default_factory=deque)  # futures of waiting background requests
    _in_flight: int = 0
    _batch_ids: itertools.count = field(default_factory=itertools.count)
    _executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "cohort-plan"))
    _tasks: set = field(default_factory=set)

    async def admit(self, text: str, policy: str) -> Admission:
        """Wait until this request's turn at the backend; the caller must `release()` afterwards."""
        ticket = _Ticket(text, policy, self.clock(), asyncio.get_running_loop().create_future())
        window = self._windows.setdefault(policy, [])
        window.append(ticket)
        self.metrics.waiting.inc()
        if len(window) >= self.flush_size or self.max_wait_s <= 0:
            self._flush(policy, "size" if len(window) >= self.flush_size else "deadline")
        elif len(window) == 1:
            asyncio.get_running_loop().call_later(self.max_wait_s, self._deadline, policy, ticket)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise

    async def admit_background(self) -> None:
        """Wait for a slot that no ready request wants; the caller must `release()` afterwards."""
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

    def release(self) -> None:
        """Free the slot of an admitted request (answered, failed or abandoned)."""
        self._in_flight -= 1
        self.metrics.in_flight.set(self._in_flight)
        self._pump()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _deadline(self, policy: str, ticket: _Ticket) -> None:
        if ticket.state == "window" and ticket in self._windows.get(policy, ()):
            self._flush(policy, "deadline")

    def _flush(self, policy: str, reason: str) -> None:
        tickets = self._windows.pop(policy, [])
        if not tickets:
            return
        self.metrics.flushes.labels(reason).inc()
        for t in tickets:
            t.state = "planning"
        if len(tickets) == 1:
            self._enqueue(tickets, [[0]])
            return
        task = asyncio.get_running_loop().create_task(self._plan_and_enqueue(tickets))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _plan_and_enqueue(self, tickets: list[_Ticket]) -> None:
        texts = [t.text for t in tickets]
        start = time.perf_counter()
        try:
            batches = await asyncio.get_running_loop().run_in_executor(self._executor, self.plan_fn, texts, self.batch_size)
        except Exception:  # a planner failure must not lose requests: fall back to arrival order
            log.exception("planning %d requests failed; dispatching them in arrival order", len(texts))
            batches = arrival_plan(len(texts), self.batch_size)
        self.metrics.plan_seconds.observe(time.perf_counter() - start)
        self._enqueue(tickets, batches)

    def _enqueue(self, tickets: list[_Ticket], batches: list[Sequence[int]]) -> None:
        for batch in batches:
            batch_id = f"b{next(self._batch_ids)}"
            self.metrics.batch_size.observe(len(batch))
            for i in batch:
                ticket = tickets[i]
                if ticket.state == "planning":
                    ticket.state, ticket.batch_id = "ready", batch_id
                    self._ready.append(ticket)
        self._pump()

    def _pump(self) -> None:
        while self._in_flight < self.max_in_flight and self._ready:
            ticket = self._next_ready()
            if ticket.state != "ready":
                continue  # cancelled while queued
            ticket.state = "admitted"
            self._in_flight += 1
            queue_s = self.clock() - ticket.arrived
            self.metrics.in_flight.set(self._in_flight)
            self.metrics.waiting.dec()
            self.metrics.queue_seconds.observe(queue_s)
            ticket.future.set_result(Admission(ticket.batch_id, queue_s))
        while self._in_flight < self.max_in_flight and self._background:
            future = self._background.popleft()
            if future.done():
                continue  # cancelled while waiting
            self._in_flight += 1
            self.metrics.in_flight.set(self._in_flight)
            future.set_result(None)

    def _next_ready(self) -> _Ticket:
        """The head of the ready queue, unless a request there is past the fairness bound."""
        now = self.clock()
        overdue = [t for t in self._ready if t.state == "ready" and now - t.arrived > self.max_queue_s]
        if overdue:
            oldest = min(overdue, key=lambda t: t.arrived)
            self._ready.remove(oldest)
            return oldest
        return self._ready.popleft()

    def _cancel(self, ticket: _Ticket) -> None:
        if ticket.state == "admitted":
            self.release()
            return
        if ticket.state == "window":
            self._windows.get(ticket.policy, []).remove(ticket)
        if ticket.state != "cancelled":
            self.metrics.waiting.dec()
        ticket.state = "cancelled"
