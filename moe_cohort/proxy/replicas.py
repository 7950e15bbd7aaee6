"""Several vLLM replicas behind the proxy: per-replica capacity and health, routing by expert affinity.

Issue 18, "Several backends in the proxy". `cohort serve --backend A --backend B` (proxy/app.py): the
AdmissionGate (proxy/gate.py) profiles each request and takes its slot here; one backend is a
set of one replica, so both cases share this one code path.

- `ReplicaSet` holds R `BackendClient`s, each with its capacity (that vLLM's max_num_seqs, as
  `max_in_flight` is for one backend), and one `admission.router.ReplicaRouter`, the rule the
  engine replay measures (eval.replicas, benchmarks/bench_replicas.py). A request waits in the
  router until a slot frees on a healthy replica; with "affinity" that replica takes the waiting
  request whose predicted profile (the vector the caller passes: proxy.profiles) fits its own
  residents best. Nobody waits while a healthy replica has a free slot; the fairness bound
  `max_queue_s` goes first, as in proxy.gate.
- Health: `check()` probes every replica's GET /health (vLLM serves it). A replica that fails the
  probe, or is found down during a request (`failover`), is taken out at once: it is offered nothing
  new and its round-robin queue moves to the others. `check()` takes it back once it answers. When
  the last replica goes out, every waiting request fails with BackendUnreachable (a 502), none hangs.
- Failover, never twice (`failover`): a request goes to another replica only if its own is down and
  generating nothing: its connect failed (it never got the request), or its connection broke before
  any byte of the answer came back and the replica is out already or fails a probe on a fresh
  connection at once (a killed vLLM's port refuses it; pooled connections to it reset). A replica
  that still answers may be generating the request: the caller answers 502, never a resend; an
  answer under way is never resent either. Streams take an `acquire()` lease and stream from its
  client; a stream under way when its replica dies is ended by the streaming code with an SSE error
  event, as with one backend.
- `models()`: the healthy replicas' /v1/models lists merged by model id (first replica wins).
- Background work (the Batch API's jobs): `acquire_background()` gets a slot only when no waiting
  request can use it (every replica with a free slot has nobody waiting for it).
- A client of None is a slot-only replica (tests of the admission order, which talk to no backend).
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

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.router import ReplicaRouter, ResidentFactory
from moe_cohort.proxy.backend_client import BackendAnswer, BackendClient
from moe_cohort.proxy.http.errors import BackendError, BackendUnreachable

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Lease:
    """A slot on one replica: talk to `client`, then `ReplicaSet.release(lease)`."""

    replica: int
    client: BackendClient
    queue_s: float
    ticket: _Ticket = field(repr=False)  # the router's key of this request


@dataclass(eq=False)
class _Ticket:
    vector: np.ndarray | None  # [L*E] predicted profile (or [D] embedding), None: first come, first served
    arrived: float
    future: asyncio.Future


class ReplicaSet:
    """R backends, their capacities and health, and the routing of admission.router; see the module docstring."""

    def __init__(self, clients: Sequence[BackendClient], capacities: Sequence[int], routing: str = "affinity", *,
                 max_queue_s: float = 30.0, max_passed: int | None = None, health_timeout_s: float = 5.0,
                 failover_probe_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 resident_factory: ResidentFactory = lambda size: ResidentExperts(1, size)):
        if len(clients) != len(capacities) or not clients:
            raise ValueError(f"one capacity per backend: {len(clients)} backend(s), {len(capacities)} capacities")
        self.clients = list(clients)
        self.router = ReplicaRouter(capacities, routing, max_wait=max_queue_s, max_passed=max_passed,
                                    resident_factory=resident_factory)
        self.health_timeout_s, self.failover_probe_s, self.clock = health_timeout_s, failover_probe_s, clock
        self._waiting: set[_Ticket] = set()
        self._background: list[_Ticket] = []  # waiting background work, oldest first
        self._turn = 0

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    @property
    def size(self) -> int:
        return len(self.clients)

    def set_capacity(self, replica: int, slots: int) -> None:
        """Let `slots` requests be at `replica` at once from now on (a request there beyond them stays until it
        finishes); waiting requests take the new room at once."""
        if slots < 1:
            raise ValueError(f"a replica needs >= 1 slot, got {slots}")
        self.router.capacity[replica] = slots
        self._pump()

    def in_flight(self) -> int:
        return int(self.router.busy.sum())

    async def acquire(self, vector: np.ndarray | None = None, arrived: float | None = None) -> Lease:
        """Wait for a slot on a healthy replica, by the routing; the caller must `release()` the lease.
        `arrived` (default: now) is when the request arrived, for the fairness bound."""
        arrived = self.clock() if arrived is None else arrived
        return await self._wait(_Ticket(vector, arrived, asyncio.get_running_loop().create_future()))

    async def acquire_background(self) -> Lease:
        """Wait for a slot that no waiting request wants (Batch API work); `release()` it afterwards."""
        if not self.router.healthy.any():
            raise _none_healthy()
        ticket = _Ticket(None, self.clock(), asyncio.get_running_loop().create_future())
        self._background.append(ticket)
        self._pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket.future.done() and not ticket.future.cancelled():
                self.release(ticket.future.result())  # granted, but the waiter left before using the slot
            elif ticket in self._background:
                self._background.remove(ticket)
            raise

    async def failover(self, lease: Lease, exc: BackendError) -> bool:
        """Whether a request that failed with `exc` on `lease` may go to another replica (see the module
        docstring: its replica is down, no byte of the answer came back, another replica exists); then
        `lease`'s replica is taken out at once. The caller releases `lease` and acquires a new slot."""
        if self.size < 2 or not isinstance(exc, BackendUnreachable) or exc.answer_started:
            return False
        if (not _never_sent(exc) and self.router.healthy[lease.replica]
                and await lease.client.alive(self.failover_probe_s)):
            return False  # the replica is up: it may be generating this request
        log.warning("replica %d (%s) is down (%s); taking it out and sending the request elsewhere",
                    lease.replica, lease.client.base_url, exc.message)
        self.set_healthy(lease.replica, False)
        return True

    def any_client(self) -> BackendClient:
        """A healthy replica's client for requests that take no slot (relayed routes), in turn."""
        up = np.flatnonzero(self.router.healthy)
        if len(up) == 0:
            raise _none_healthy()
        self._turn += 1
        return self.clients[int(up[self._turn % len(up)])]

    def release(self, lease: Lease) -> None:
        """The request on `lease` is done (answered, failed or abandoned): its slot frees."""
        self.router.release(lease.ticket)
        self._pump()

    async def request(self, method: str, path: str, *, json: dict | None = None, headers: dict[str, str] | None = None,
                      vector: np.ndarray | None = None) -> tuple[int, BackendAnswer]:
        """(replica, whole answer) of one request, resent elsewhere only if no backend accepted it."""
        ticket = _Ticket(vector, self.clock(), asyncio.get_running_loop().create_future())
        while True:
            lease = await self._wait(ticket)
            try:
                return lease.replica, await lease.client.request(method, path, json=json, headers=headers)
            except BackendUnreachable as exc:
                if not await self.failover(lease, exc):
                    raise
                ticket.future = asyncio.get_running_loop().create_future()
            finally:
                self.release(lease)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Take a replica out of the routing or back in; with none left, every waiting request fails."""
        if bool(self.router.healthy[replica]) == healthy:
            return
        log.warning("replica %d (%s) %s", replica, self.clients[replica].base_url, "is back" if healthy else "is out")
        self.router.set_healthy(replica, healthy)
        if not self.router.healthy.any():
            for ticket in list(self._waiting):
                self.router.remove(ticket)
                self._waiting.discard(ticket)
                ticket.future.set_exception(_none_healthy())
            for ticket in self._background:
                ticket.future.set_exception(_none_healthy())
            self._background.clear()
        self._pump()

    async def check(self) -> list[bool]:
        """Probe every replica's GET /health (at most `health_timeout_s` each, all at once); update health."""
        results = await asyncio.gather(*(c.alive(self.health_timeout_s) for c in self.clients))
        for r, ok in enumerate(results):
            self.set_healthy(r, ok)
        return list(results)

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

    async def _wait(self, ticket: _Ticket) -> Lease:
        if not self.router.healthy.any():
            raise _none_healthy()
        replica = self.router.place_at_once(ticket, ticket.vector)  # a slot free and nobody waiting
        if replica is not None:
            return Lease(replica, self.clients[replica], self.clock() - ticket.arrived, ticket)
        self.router.add(ticket, ticket.vector, ticket.arrived)
        self._waiting.add(ticket)
        self._pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket in self._waiting:
                self.router.remove(ticket)
                self._waiting.discard(ticket)
            elif ticket.future.done() and not ticket.future.cancelled():
                self.release(ticket.future.result())  # granted, but the waiter left before using the slot
            raise

    def _pump(self) -> None:
        if not self._background and not self.router.waiting():
            return  # nobody to admit
        now, admitted = self.clock(), True
        while admitted:
            admitted = False
            for ticket, replica in self.router.admit(now):
                self._waiting.discard(ticket)
                if ticket.future.done():  # its waiter was cancelled and has not run its cleanup yet
                    self.router.release(ticket)
                    admitted = True  # the slot is free again: admit once more
                    continue
                ticket.future.set_result(Lease(replica, self.clients[replica], now - ticket.arrived, ticket))
        while self._background and self.router.free().max(initial=0) > 0:  # no waiting request wants these
            ticket = self._background.pop(0)
            if ticket.future.done():  # cancelled while waiting
                continue
            replica = int(np.argmax(self.router.free()))
            self.router.hold(ticket, replica)
            ticket.future.set_result(Lease(replica, self.clients[replica], now - ticket.arrived, ticket))


def _never_sent(exc: BackendUnreachable) -> bool:
    """Whether the backend certainly never got the request: the connect itself failed (refused, unreachable)."""
    return isinstance(exc.__cause__, aiohttp.ClientConnectorError)


def _none_healthy() -> BackendUnreachable:
    return BackendUnreachable("no healthy backend replica: every --backend is out (refused connections or failed "
                              "health checks); check that the vLLM servers are running")
