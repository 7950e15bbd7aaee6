"""Online admission: requests take the backend's slots in the order that keeps the resident experts few.

vLLM keeps up to max_num_seqs requests resident and replaces a finished one at once; reordering
can only act while requests wait for a slot. So the proxy holds at most `max_in_flight` requests
(the backend's max_num_seqs) at the backend, and when a slot frees it admits, from one waiting
pool, the request expected to add the fewest experts per step to those in flight
(`admission.waiting.WaitingPool`: fairness bound `max_queue_s` first, FCFS for requests without a
profile). When a slot is free nobody waits: there is nothing to reorder.

Each request's expert profile is predicted once, on arrival, by a `Profiler` (encoder embedding
-> profile head, in one worker thread, batched with whatever else arrived meanwhile, off the
event loop). The rule is work conservation: while requests wait, no backend slot is idle because of
the proxy's own work, so a prediction never stands between a request and a free slot. A request
that finds a free slot with nobody waiting goes at once; one that has to wait joins the pool at
once, first come, first served (`admission.waiting`, rule 2) until its prediction lands, which then
re-scores it in place; either way its profile joins its replica's resident set when predicted, so
later choices count its experts. A predictor with nothing to predict yet (a learning proxy before
its first head) is not asked at all.

With `profile_first` (an engine running our scheduler admits from its own queue) the prediction is
forwarded as `vllm_xargs.moe_profile` so the engine can choose by it; a request then waits for its
prediction (at most `deadline_s`) only while the engines are fed: at least `fed_at` requests at the
backends, every engine's slots taken and a queue of its own to refill them from. Below that the engine
has room, there is nothing for it to choose, and the request goes at once without its profile.
Background work (the Batch API's jobs) shares the slots through `admit_background()` but only
gets one that no waiting request wants. Nothing here knows HTTP: a
caller awaits `admit()` for a `send.replicas.Slot`, talks to the backend, then calls `release(slot)`
(send/lifecycle.py does this for every request the proxy sends).

The slots are a `send.replicas.ReplicaSet`: one backend is a set of one replica, several backends
(`--backend` repeated) a set of R, each with `max_in_flight` slots, routed by `--replica-routing`
(admission.router.ReplicaRouter; "affinity" is this module's rule applied per replica), the same
router that drives the batch order (batch.order) and the engine replay (eval.replay). A
slot names its replica (`slot.client`); `failover()` and `readmit()` move a request whose
replica is down (it generated nothing of it) to another one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from prometheus_client import Histogram

from moe_cohort.admission.wire import Prediction
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.profiles import PredictFn
from moe_cohort.send.replicas import ReplicaSet, Slot

log = logging.getLogger(__name__)

LATE_PROFILE_S = 0.02  # how long a request admitted at once waits before its profile is predicted


class Profiler:
    """Predicted profiles of texts, one worker thread, batched with whatever arrived meanwhile."""

    def __init__(self, predict: PredictFn, seconds: Histogram | None = None,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.predict, self.seconds = predict, seconds  # seconds: observes each batch's prediction time
        self.ready = ready  # whether `predict` would predict anything now (send.profiles.Predictor.ready)
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, "cohort-profile")

    async def profile(self, text: str) -> Prediction | None:
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


@dataclass
class AdmissionGate:
    """Predictions on arrival (`profiler`; None: every request first come, first served), then a slot from
    `replicas` (one backend is a set of one); the metrics waiting / in_flight / queue_seconds."""

    profiler: Profiler | None
    metrics: Metrics
    replicas: ReplicaSet
    # True: the prediction is forwarded (an engine with our scheduler chooses by it), so a request waits for it
    # while the engines are fed (`fed_at`); False: admission is the proxy's, and no request waits for its prediction
    profile_first: bool = True
    deadline_s: float = 0.05  # longest wait for a prediction with profile_first; past it the request goes without
    fed_at: int = 0  # requests at the backends from which every engine has its slots taken and a queue of its own
    _late: set[asyncio.Task] = field(default_factory=set)  # predictions of requests that went on without theirs
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def clock(self) -> Callable[[], float]:
        return self.replicas.clock

    async def admit(self, text: str) -> Slot:
        """Wait until this request's turn at a backend; the caller must `release()` its slot afterwards."""
        slot = Slot(arrived=self.clock())
        self.metrics.waiting.inc()
        if self.profiler is None or not self.profiler.ready():  # nothing to predict with: first come, first served
            return await self._acquire(slot)
        if self.profile_first and self.replicas.in_flight() >= self.fed_at:
            return await self._admit_predicted(slot, text)
        if self.replicas.router.places_at_once():  # a free slot, nobody waiting: nothing to choose
            await self._acquire(slot)
            self._join_later(slot, self._profile_after(LATE_PROFILE_S, text))
            return slot
        self._join_later(slot, self.profiler.profile(text))  # waits first come, first served until predicted
        return await self._acquire(slot)

    async def _admit_predicted(self, slot: Slot, text: str) -> Slot:
        """`slot` admitted with its prediction (at most `deadline_s` waited for; past it the request goes on
        without, and its profile joins the resident set when it comes)."""
        predicting = asyncio.ensure_future(self.profiler.profile(text))
        try:
            prediction = await asyncio.wait_for(asyncio.shield(predicting), self.deadline_s)
        except TimeoutError:
            self.metrics.profile_late.inc()
            prediction = None
        except asyncio.CancelledError:
            self.metrics.waiting.dec()
            raise
        if prediction is not None:
            slot.vector, slot.prediction = prediction.vector, prediction
        await self._acquire(slot)
        if prediction is None and not predicting.done():
            self._join_later(slot, predicting)
        return slot

    async def _profile_after(self, delay_s: float, text: str) -> Prediction | None:
        """The profile of a request admitted at once, predicted after `delay_s`: a burst of arrivals is taken in
        first and predicted after, in larger batches (fewer, larger encoder calls: less of the proxy's own time)."""
        await asyncio.sleep(delay_s)
        return await self.profiler.profile(text)

    def _join_later(self, slot: Slot, prediction: Awaitable[Prediction | None]) -> None:
        """The request's profile, once predicted, re-scores it where it waits, or joins its replica's resident set
        where it was admitted (send.replicas.ReplicaSet.predicted); nothing once it finished."""
        async def join() -> None:
            predicted = await prediction  # None when the encoder failed
            if predicted is not None:
                self.replicas.predicted(slot, predicted)
        task = asyncio.get_running_loop().create_task(join())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def failover(self, slot: Slot, exc: Exception) -> bool:
        """Whether `slot`'s request may go to another replica after `exc` (send.replicas.ReplicaSet.failover:
        its replica is down and no byte of the answer came back); that replica is then taken out. The caller
        releases `slot` and asks `readmit(slot)` for a place elsewhere."""
        return await self.replicas.failover(slot, exc)

    async def readmit(self, slot: Slot) -> Slot:
        """`slot` again, on another replica after a failover: same prediction, its place by its first arrival."""
        self.metrics.waiting.inc()
        return await self._acquire(slot)

    async def admit_background(self) -> Slot:
        """Wait for a slot that no waiting request wants; the caller must `release()` it afterwards."""
        return await self._acquire(Slot(background=True))

    def release(self, slot: Slot) -> None:
        """Free the slot of an admitted request (answered, failed or abandoned)."""
        self.replicas.release(slot)
        self._in_flight_changed()

    def close(self) -> None:
        for task in self._late:
            task.cancel()
        if self.profiler is not None:
            self.profiler.close()

    async def _acquire(self, slot: Slot) -> Slot:
        """`slot` granted; the waiting gauge (counted by the caller for a request, never for background work)
        and the in-flight gauge follow."""
        asked = self.clock()
        try:
            await self.replicas.acquire(slot)
        finally:  # granted, cancelled (a slot granted meanwhile is given back) or no healthy replica
            if not slot.background:
                self.metrics.waiting.dec()
            self._in_flight_changed()
        if not slot.background:
            self.metrics.queue_seconds.observe(slot.queue_s)
        slot.wait_s = self.clock() - asked
        slot.id = f"{'b' if slot.background else 'a'}{next(self._ids)}"  # numbered in the order admitted
        return slot

    def _in_flight_changed(self) -> None:
        self.metrics.in_flight.set(self.replicas.in_flight())


class OneBackend:
    """Admission for a caller that counts its own slots on one backend (`cohort batch run`: its core sends at most
    its in-flight cap, in the order it chose): a request is granted at once, so each line is admitted once and its
    slot counted once. Speaks for AdmissionGate to a Lifecycle; a request whose backend is down is not moved."""

    def __init__(self, client: BackendClient, metrics: Metrics) -> None:
        self.client, self.metrics = client, metrics
        self._ids = itertools.count()

    async def admit(self, text: str = "") -> Slot:
        return self._slot(background=False)

    async def admit_background(self) -> Slot:
        return self._slot(background=True)

    async def failover(self, slot: Slot, exc: Exception) -> bool:
        return False  # no other backend: the caller decides whether to try again

    async def readmit(self, slot: Slot) -> Slot:
        raise RuntimeError("one backend: nothing to fail over to")

    def release(self, slot: Slot) -> None:
        pass

    def _slot(self, background: bool) -> Slot:
        return Slot(background=background, id=str(next(self._ids)), replica=0, client=self.client)
