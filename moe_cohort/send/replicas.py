"""The backend's slots: R vLLM replicas, each with its capacity and health, and the routing of admission.

One backend is a set of one replica; `cohort serve --backend A --backend B` a set of two, so both share
this one code path.

- `ReplicaSet` holds R `BackendClient`s, each with its capacity (that vLLM's max_num_seqs), and one
  `admission.router.ReplicaRouter`. A request waits in the router until a slot frees on a healthy
  replica; with "affinity" that replica takes the waiting request whose predicted profile fits its own
  residents best. Nobody waits while a healthy replica has a free slot; the fairness bounds go first.
- A `Slot` is one request's place: created on arrival, granted a replica by `acquire`, freed by `release`
  exactly once. It is the router's key for the request.
- Health: `check()` probes every replica's GET /health (`BackendClient.alive`, the one liveness probe). A
  replica that fails the probe, or is found down during a request (`failover`), is taken out at once: it is
  offered nothing new. `check()` takes it back once it answers. The last healthy replica is never taken out
  by either (a set of one is never emptied): requests to it fail on their own, each with its own error. When
  `set_healthy` takes the last one out, every waiting request fails with BackendUnreachable (a 502), none hangs.
- Failover, never twice (`failover`): a request goes to another healthy replica only if its own is down and
  generating nothing: its connect failed (it never got the request), or its connection broke before any
  byte of the answer came back and the replica is out already or fails a probe on a fresh connection at
  once (a killed vLLM's port refuses it). A replica that still answers may be generating the request: the
  caller answers 502, never a resend; an answer under way is never resent either.
- Background work (the Batch API's jobs): a background slot is granted only when no waiting request can use
  it (every replica with a free slot has nobody waiting for it).
- `models()`: the healthy replicas' /v1/models lists merged by model id (first replica wins).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import aiohttp
import numpy as np

from moe_cohort.admission.fairness import MAX_WAIT_S
from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.router import ReplicaRouter, ResidentFactory
from moe_cohort.admission.wire import Prediction
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendError, BackendUnreachable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """One request's place at the backend, from its arrival until `ReplicaSet.release(slot)`."""

    vector: np.ndarray | None = None  # [L*E] predicted profile (or [D] embedding); None: first come, first served
    prediction: Prediction | None = None  # what the gate predicted before admission (forwarded to the engine)
    arrived: float | None = None  # when the request arrived (the fairness bound's clock); None: when acquired
    background: bool = False  # granted only when no waiting request can use the slot
    id: str = ""  # once granted: its number in the order admitted (X-Cohort-Admission)
    replica: int = -1  # once granted: the replica's index
    client: BackendClient | None = None  # once granted: that replica's client
    queue_s: float = 0.0  # arrival to grant
    wait_s: float = 0.0  # the wait for a slot alone (queue_s less the prediction)
    _granted: asyncio.Future | None = field(default=None, repr=False)


class ReplicaSet:
    """R backends, their capacities and health, and the routing of admission.router; see the module docstring."""

    def __init__(self, clients: Sequence[BackendClient], capacities: Sequence[int], routing: str = "affinity", *,
                 max_queue_s: float = MAX_WAIT_S, max_passed: int | None = None, health_timeout_s: float = 5.0,
                 failover_check_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 resident_factory: ResidentFactory = lambda size: ResidentExperts(1, size)):
        if len(clients) != len(capacities) or not clients:
            raise ValueError(f"one capacity per backend: {len(clients)} backend(s), {len(capacities)} capacities")
        self.clients = list(clients)
        self.router = ReplicaRouter(capacities, routing, max_wait=max_queue_s, max_passed=max_passed,
                                    resident_factory=resident_factory)
        self.health_timeout_s, self.failover_check_s, self.clock = health_timeout_s, failover_check_s, clock
        self._waiting: set[Slot] = set()
        self._background: list[Slot] = []  # waiting background work, oldest first
        self._turn = 0

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    def set_capacity(self, replica: int, slots: int) -> None:
        """Let `slots` requests be at `replica` at once from now on (a request there beyond them stays until it
        finishes); waiting requests take the new room at once."""
        if slots < 1:
            raise ValueError(f"a replica needs >= 1 slot, got {slots}")
        self.router.capacity[replica] = slots
        self._pump()

    def in_flight(self) -> int:
        return int(self.router.busy.sum())

    async def acquire(self, slot: Slot) -> Slot:
        """Wait until `slot` is granted a replica (by the routing; a background slot only when no waiting request
        can use it) and return it; the caller must `release(slot)`. A slot released after a failover may be
        acquired again: it keeps its arrival, so its place in the fairness bound."""
        if not self.router.healthy.any():
            raise _none_healthy()
        if slot.arrived is None:
            slot.arrived = self.clock()
        slot.replica, slot.client = -1, None
        slot._granted = asyncio.get_running_loop().create_future()
        if slot.background:
            self._background.append(slot)
        elif (replica := self.router.place_at_once(slot, slot.vector)) is not None:  # a slot free, nobody waiting
            self._grant(slot, replica, self.clock())
        else:
            self.router.add(slot, slot.vector, slot.arrived)
            self._waiting.add(slot)
        self._pump()
        try:
            return await slot._granted
        except asyncio.CancelledError:
            self._forget(slot)
            raise

    def predicted(self, slot: Slot, prediction: Prediction) -> None:
        """`slot`'s prediction, landed after the request arrived: a waiting request is re-scored in place (first
        come, first served until now) and carries it when admitted; an admitted one joins its replica's resident
        set; one released already is left alone."""
        if slot in self._waiting:
            slot.vector, slot.prediction = prediction.vector, prediction
            self.router.update(slot, prediction.vector)
        elif slot.client is not None:
            self.router.assign(slot, prediction.vector)

    def _forget(self, slot: Slot) -> None:
        """A waiter that left: out of the queue, or its slot given back if it was granted meanwhile."""
        if slot in self._waiting:
            self.router.remove(slot)
            self._waiting.discard(slot)
        elif slot in self._background:
            self._background.remove(slot)
        elif slot._granted.done() and not slot._granted.cancelled():
            self.release(slot)

    async def failover(self, slot: Slot, exc: BackendError) -> bool:
        """Whether a request that failed with `exc` on `slot` may go to another replica (see the module
        docstring: its replica is down, no byte of the answer came back, another replica exists); then
        `slot`'s replica is taken out at once. The caller releases `slot` and acquires it again."""
        others = np.delete(self.router.healthy, slot.replica)
        if not others.any() or not isinstance(exc, BackendUnreachable) or exc.answer_started:
            return False
        if (not _never_sent(exc) and self.router.healthy[slot.replica]
                and await slot.client.alive(self.failover_check_s)):
            return False  # the replica is up: it may be generating this request
        log.warning("replica %d (%s) is down (%s); taking it out and sending the request elsewhere",
                    slot.replica, slot.client.base_url, exc.message)
        self.set_healthy(slot.replica, False)
        return True

    def any_client(self) -> BackendClient:
        """A healthy replica's client for requests that take no slot (relayed routes), in turn."""
        up = np.flatnonzero(self.router.healthy)
        if len(up) == 0:
            raise _none_healthy()
        self._turn += 1
        return self.clients[int(up[self._turn % len(up)])]

    def release(self, slot: Slot) -> None:
        """The request on `slot` is done (answered, failed or abandoned): its slot frees."""
        self.router.release(slot)
        self._pump()

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Take a replica out of the routing or back in; with none left, every waiting request fails."""
        if bool(self.router.healthy[replica]) == healthy:
            return
        log.warning("replica %d (%s) %s", replica, self.clients[replica].base_url, "is back" if healthy else "is out")
        self.router.set_healthy(replica, healthy)
        if not self.router.healthy.any():
            for slot in [*self._waiting, *self._background]:
                self._forget(slot)
                slot._granted.set_exception(_none_healthy())
        self._pump()

    async def check(self) -> list[bool]:
        """Probe every replica's GET /health (at most `health_timeout_s` each, all at once) and update health by
        the answers, except that a probe no replica answers takes none out; returns the answers."""
        results = list(await asyncio.gather(*(c.alive(self.health_timeout_s) for c in self.clients)))
        for r, ok in enumerate(results):
            if ok or any(results):
                self.set_healthy(r, ok)
        return results

    async def models(self, headers: dict[str, str] | None = None) -> dict:
        """The healthy replicas' /v1/models, merged by model id: {"object": "list", "data": [...]}."""
        up = [c for c, ok in zip(self.clients, self.router.healthy) if ok]
        if not up:
            raise _none_healthy()
        answers = await asyncio.gather(*(c.request("GET", "/v1/models", headers=headers) for c in up),
                                       return_exceptions=True)
        data, seen, errors = [], set(), [a for a in answers if isinstance(a, BaseException)]
        for answer in answers:
            for model in [] if isinstance(answer, BaseException) else json.loads(answer.content).get("data", []):
                if model.get("id") not in seen:
                    seen.add(model.get("id"))
                    data.append(model)
        if errors and len(errors) == len(answers):
            raise errors[0]
        return {"object": "list", "data": data}

    def _pump(self) -> None:
        if not self._background and not self.router.waiting():
            return  # nobody to admit
        now, admitted = self.clock(), True
        while admitted:
            admitted = False
            for slot, replica in self.router.admit(now):
                self._waiting.discard(slot)
                if slot._granted.done():  # its waiter was cancelled and has not run its cleanup yet
                    self.router.release(slot)
                    admitted = True  # the slot is free again: admit once more
                    continue
                self._grant(slot, replica, now)
        while self._background and self.router.free().max(initial=0) > 0:  # no waiting request wants these
            slot = self._background.pop(0)
            if slot._granted.done():  # cancelled while waiting
                continue
            replica = int(np.argmax(self.router.free()))
            self.router.hold(slot, replica)
            self._grant(slot, replica, now)

    def _grant(self, slot: Slot, replica: int, now: float) -> None:
        slot.replica, slot.client, slot.queue_s = replica, self.clients[replica], now - slot.arrived
        slot._granted.set_result(slot)


def _never_sent(exc: BackendUnreachable) -> bool:
    """Whether the backend certainly never got the request: the connect itself failed (refused, unreachable)."""
    return isinstance(exc.__cause__, aiohttp.ClientConnectorError)


def _none_healthy() -> BackendUnreachable:
    return BackendUnreachable("no healthy backend replica: every --backend is out (refused connections or failed "
                              "health checks); check that the vLLM servers are running")
