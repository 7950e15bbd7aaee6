"""Which replica admits which waiting request: routing over R engine replicas (data parallel).

Each replica r keeps up to `slots[r]` requests resident (vLLM's max_num_seqs) and a step of
replica r loads the experts of ITS residents only, so what routing decides is which requests are
resident together on one replica. `ReplicaRouter` is pure bookkeeping (no clock, no I/O): a
caller adds waiting requests, asks `admit(now)` which request takes which free slot, and
releases a request when it finishes. It is the one admission rule: the proxy's gate
(send.replicas, one backend or several), the Ray Serve request router (ray_serve.router, told of
one free replica at a time: `admit_to`), the batch order (batch.order, one replica of
`--max-in-flight` slots) and the engine replay (eval.replay) all admit through it; only vLLM's own
queue (engine.expert_queue) keeps the pool and a resident set without it. Routings (`ROUTINGS`, what
the proxy serves):

- "affinity": one shared waiting pool (admission.waiting.WaitingPool). When replica r has a free
  slot it admits, by the pool's one rule, the waiting request that best fits r's own resident set
  (fairness bound first, FCFS for requests without a vector, then the lowest cost to r's resident
  set, admission.resident.Resident.cost: with ResidentExperts the fewest expected new experts per step).
- "least-loaded": the same shared pool, first come first served (fairness bound first).
- "round-robin": bound on arrival: the i-th request goes to the queue of replica i mod R (the
  healthy ones); each replica serves its own queue first come first served.

When several replicas have free slots, the one with the most free slots admits first (ties: the
lowest index), one request at a time, so R empty replicas take R different seeds before any of
them fills up. Load bound: with a shared pool a free slot takes a waiting request at once, so no
replica idles while another has a queue (`idle_while_queued` says whether that holds now);
a routing that binds on arrival can break it, when one replica's queue runs dry before another's.

A subclass adds routings that bind on arrival (`routings`, `on_arrival`): `_bind` picks the queue,
`_join` and `_leave` keep what a queued request carries (benchmarks/ray_routers.py replays Ray Serve's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from moe_cohort.admission.resident import Resident, ResidentExperts
from moe_cohort.admission.waiting import WaitingPool

ROUTINGS = ("round-robin", "least-loaded", "affinity")  # what the proxy serves
ResidentFactory = Callable[[int], Resident]  # vector size -> an empty resident set


class ReplicaRouter:
    """R replicas' free slots, resident sets and health, and the waiting requests; see the module docstring."""

    routings: tuple[str, ...] = ROUTINGS  # the routings this class admits by
    on_arrival: tuple[str, ...] = ("round-robin",)  # those bound to a replica's own queue on arrival

    def __init__(self, slots: Sequence[int], routing: str = "affinity", *, max_wait: float | None = None,
                 max_passed: int | None = None, resident_factory: ResidentFactory = lambda size: ResidentExperts(1, size)):
        if routing not in self.routings:
            raise ValueError(f"routing must be one of {', '.join(self.routings)}, got {routing!r}")
        if len(slots) < 1 or min(slots) < 1:
            raise ValueError(f"every replica needs >= 1 slot, got {list(slots)}")
        self.routing, self.max_wait, self.max_passed = routing, max_wait, max_passed  # admission.waiting's bounds
        self.capacity = np.asarray(slots, np.int64)  # [R]
        self.busy = np.zeros(len(slots), np.int64)  # [R] admitted, not yet released
        self.healthy = np.ones(len(slots), bool)  # [R] a replica that is down admits nothing
        self.pool = WaitingPool()  # shared: least-loaded and affinity
        self.queues: list[deque] = [deque() for _ in slots]  # per replica: the routings of on_arrival
        self.placed: dict[Hashable, tuple[int, np.ndarray | None]] = {}  # admitted key -> (replica, vector held)
        self._factory = resident_factory
        self._residents: list[Resident | None] = [None] * len(slots)
        self._vectors: dict[Hashable, np.ndarray | None] = {}  # waiting key -> vector (queues of on_arrival)
        self._turn = 0  # round-robin: requests bound so far

    @property
    def replicas(self) -> int:
        return len(self.capacity)

    def add_replica(self, slots: int) -> int:
        """A new replica of `slots` slots, healthy and empty (a replica set that scales up, or replaces one
        that died: the dead one stays, out of the routing); returns its index."""
        if slots < 1:
            raise ValueError(f"every replica needs >= 1 slot, got {slots}")
        self.capacity = np.append(self.capacity, slots)
        self.busy = np.append(self.busy, 0)
        self.healthy = np.append(self.healthy, True)
        self.queues.append(deque())
        self._residents.append(None)
        return self.replicas - 1

    def free(self) -> np.ndarray:  # [R] free slots of the healthy replicas (0 for those down)
        return np.where(self.healthy, np.maximum(self.capacity - self.busy, 0), 0)  # capacity may have shrunk

    def waiting(self) -> int:
        return len(self.pool) + sum(len(q) for q in self.queues)

    def add(self, key: Hashable, vector: np.ndarray | None, now: float) -> None:
        """A request arrives: `vector` is its flat predicted profile [L*E] (or embedding), None for FCFS."""
        if key in self.placed or key in self._vectors or key in self.pool:
            raise ValueError(f"{key!r} is routed already")
        if self.routing not in self.on_arrival:
            self.pool.add(key, vector, now)
            return
        up = np.flatnonzero(self.healthy)  # [H]
        if len(up) == 0:
            raise ValueError("no healthy replica to queue the request on")
        self._join(self._bind(up), key, vector, now)

    def remove(self, key: Hashable) -> None:
        """A waiting request leaves before admission (its client went away)."""
        if key in self.pool:
            self.pool.remove(key)
            return
        if key not in self._vectors:
            raise KeyError(key)
        r = next(r for r, q in enumerate(self.queues) if key in q)
        self.queues[r].remove(key)
        self._leave(r, key)

    def update(self, key: Hashable, vector: np.ndarray | None) -> None:
        """A new prediction for a waiting request (a newer profile head's); it keeps its place in the queue."""
        if key in self.pool:
            self.pool.update(key, vector)
        elif key in self._vectors:
            self._vectors[key] = vector
        else:
            raise KeyError(f"{key!r} is not waiting")

    def admit(self, now: float) -> list[tuple[Hashable, int]]:
        """Fill the free slots now: (key, replica) per admission, in admission order."""
        out = []
        while True:
            free = np.where([self._has_candidate(r) for r in range(self.replicas)], self.free(), 0)  # [R]
            if free.max(initial=0) <= 0:
                return out
            r = int(np.argmax(free))  # most free slots first, ties to the lowest index
            out.append((self.admit_to(r, now), r))

    def admit_to(self, replica: int, now: float) -> Hashable | None:
        """The request that a free slot of `replica` admits now, by the routing's rule (fairness bound first),
        placed there; None when the replica is down or full, or no request waits for it. For a caller that
        learns of free slots one replica at a time (a Ray Serve request router); `admit` fills them all."""
        if self.free()[replica] <= 0 or not self._has_candidate(replica):
            return None
        key = self._choose(replica, now)
        self._place(key, replica)
        return key

    def place_at_once(self, key: Hashable, vector: np.ndarray | None) -> int | None:
        """A request that arrives while nobody waits and a slot is free: placed now, on the replica with the
        most free slots, exactly as `add` + `admit` would place it, without the pool's bookkeeping (the
        proxy's common case: a slot free, nothing to reorder). Returns the replica, or None when the
        request must go through `add` (a queue, a routing that binds on arrival). A vector may also come
        later (`assign`)."""
        if not self.places_at_once() or key in self.placed:
            return None
        r = int(np.argmax(self.free()))
        self.placed[key] = (r, None)
        self.busy[r] += 1
        if vector is not None:
            self.assign(key, vector)
        return r

    def places_at_once(self) -> bool:
        """Whether a request arriving now is placed at once (`place_at_once`): a shared pool, nobody
        waiting, a free slot on a healthy replica."""
        return (self.routing not in self.on_arrival and not self.waiting()
                and self.free().max(initial=0) > 0)

    def assign(self, key: Hashable, vector: np.ndarray) -> bool:
        """The vector of a request placed without one (the proxy forwards a request that finds a free slot
        while its profile is still being predicted): it joins its replica's resident set now, as if placed
        with it, and leaves it on `release`. False, and nothing done, when `key` is not placed (released
        already) or holds a vector, the routing is not affinity, or the vector has another size."""
        if self.routing != "affinity" or key not in self.placed or self.placed[key][1] is not None:
            return False
        held = self.pool.fit(vector)  # [F]; another size counts as no vector, as in the pool
        if held is None:
            return False
        r = self.placed[key][0]
        self._resident_for(r).add(held)
        self.placed[key] = (r, held)
        return True

    def hold(self, key: Hashable, replica: int) -> None:
        """A slot of `replica` taken outside the waiting pool (background work that no waiting request
        wanted it for); `release(key)` frees it."""
        if key in self.placed:
            raise ValueError(f"{key!r} holds a slot already")
        self.placed[key] = (replica, None)
        self.busy[replica] += 1

    def release(self, key: Hashable) -> int:
        """An admitted request finished (or failed): its slot frees; returns its replica."""
        r, vector = self.placed.pop(key)
        self.busy[r] -= 1
        if vector is not None:
            self._residents[r].remove(vector)
        return r

    def set_healthy(self, replica: int, healthy: bool) -> list[Hashable]:
        """Take a replica out (or back in). Out: its queue (routings that bind on arrival) is routed again
        over the other healthy replicas, in order; the keys moved are returned. Its admitted requests stay
        placed until released."""
        self.healthy[replica] = healthy
        if healthy or not self.queues[replica] or not self.healthy.any():
            return []  # with no healthy replica left the queue stays where it is
        moved = list(self.queues[replica])
        self.queues[replica].clear()
        for key in moved:
            self.add(key, self._vectors.pop(key), now=0.0)
        return moved

    def idle_while_queued(self) -> bool:
        """Whether a healthy replica has a free slot while some request waits (the load bound is broken)."""
        return bool(self.free().max(initial=0) > 0 and self.waiting() > 0)

    def resident(self, replica: int) -> Resident | None:
        """Replica's resident set (affinity only; None before the first vector)."""
        return self._residents[replica]

    def load(self) -> np.ndarray:  # [R] requests per replica: admitted + queued on it
        return self.busy + np.array([len(q) for q in self.queues], np.int64)

    def _bind(self, up: np.ndarray) -> int:
        """The replica among the healthy `up` [H] whose queue an arriving request joins: round-robin's turn."""
        self._turn += 1
        return int(up[(self._turn - 1) % len(up)])

    def _join(self, r: int, key: Hashable, vector: np.ndarray | None, now: float) -> None:
        """`key` joins replica r's queue, keeping its vector."""
        self.queues[r].append(key)
        self._vectors[key] = vector

    def _leave(self, r: int, key: Hashable, admitted: bool = False) -> np.ndarray | None:
        """`key`, already out of replica r's queue, is removed (or `admitted`); returns the vector it kept."""
        return self._vectors.pop(key)

    def _has_candidate(self, r: int) -> bool:
        return bool(self.queues[r]) if self.routing in self.on_arrival else len(self.pool) > 0

    def _choose(self, r: int, now: float) -> Hashable:
        if self.routing in self.on_arrival:
            return self.queues[r].popleft()
        resident = self._resident_for(r) if self.routing == "affinity" else None
        return self.pool.pick(resident, now, self.max_wait, self.max_passed)

    def _place(self, key: Hashable, r: int) -> None:
        if self.routing in self.on_arrival:
            vector = self._leave(r, key, admitted=True)
        else:
            row = self.pool.rows[key]
            vector = self.pool.matrix[row].copy() if self.pool.profiled[row] else None
            self.pool.remove(key, admitted=True)
        held = None
        if self.routing == "affinity" and vector is not None:
            held = vector
            self._resident_for(r, len(vector)).add(held)
        self.placed[key] = (r, held)
        self.busy[r] += 1

    def _resident_for(self, r: int, size: int | None = None) -> Resident | None:
        """Replica r's resident set of vectors of `size` (default: the shared pool's); None before any size."""
        size = self.pool.size if size is None else size
        if size is None:
            return None
        if self._residents[r] is None or self._residents[r].size != size:
            self._residents[r] = self._factory(size)
        return self._residents[r]

