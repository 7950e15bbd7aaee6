"""Ray Serve's request routers, replayed against ours: `RayRouter`, an admission.router.ReplicaRouter with
routings that bind a request to a replica's own queue on arrival, as Ray Serve's do when they dispatch to
replicas that take many requests each (a large max_ongoing_requests) and vLLM serves its own queue first
come first served. Pure bookkeeping over the replicas' loads; no clock, no I/O.

- "power-of-two" (Ray Serve's default router): two distinct healthy replicas drawn at random,
  `rng.choice(healthy, 2, replace=False)` from the seeded Generator, and the request goes to the one with
  fewer requests (resident + queued), ties to the lower index; with one healthy replica, that one, and
  nothing drawn.
- "prefix" (Ray Serve LLM's PrefixCacheAffinityRouter): the request goes to the replica that was last
  given a request with its longest matching prompt prefix, compared in blocks (`prefix_blocks`: a text's
  first 64 characters in blocks of 16, the last one possibly shorter; or the caller's own tuple of
  chunks). A table maps every block-prefix (the first d blocks, d >= 1) of every routed request to the
  replica it went to, the oldest entries dropped past `prefix_entries`. When the load imbalance (max - min
  of resident + queued over the healthy replicas) exceeds `imbalance` (default: the most slots of a
  replica), or no block-prefix of the request maps to a healthy replica, it falls back to power-of-two.
  Only this routing reads the prefix (`add(..., prefix=)`); a request moved off a replica that went down
  keeps its own.

`inside` (routings that bind on arrival only, round-robin included): each replica admits from its own queue
by the waiting pool's rule against its own residents (fairness bound first, then the lowest cost), as vLLM
with our scheduler does behind such a router; without it, each queue is first come, first served.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from moe_cohort.admission.router import ROUTINGS, ReplicaRouter
from moe_cohort.admission.waiting import WaitingPool

RAY_ROUTINGS = ("power-of-two", "prefix")  # Ray Serve's request routers, replayed against ours
PREFIX_CHARS, PREFIX_BLOCK = 64, 16  # "prefix": a text's first 64 characters, compared in blocks of 16
Prefix = str | tuple  # a prompt text, or a tuple of hashable chunks


class RayRouter(ReplicaRouter):
    """ReplicaRouter with Ray Serve's routings and `inside`; see the module docstring."""

    routings = ROUTINGS + RAY_ROUTINGS
    on_arrival = ("round-robin", *RAY_ROUTINGS)

    def __init__(self, slots: Sequence[int], routing: str = "affinity", *, rng: np.random.Generator | None = None,
                 imbalance: int | None = None, prefix_entries: int = 1 << 16, inside: bool = False, **options):
        super().__init__(slots, routing, **options)
        if inside and routing not in self.on_arrival:
            raise ValueError(f"inside: only a routing that binds on arrival has queues per replica, not {routing!r}")
        self._rng = np.random.default_rng(0) if rng is None else rng  # power-of-two's draws
        self.imbalance = int(self.capacity.max()) if imbalance is None else imbalance
        self.prefix_entries = prefix_entries
        self._served: dict[tuple, int] = {}  # block-prefix -> the replica last given it, oldest first (prefix)
        self._prefixes: dict[Hashable, Prefix | None] = {}  # waiting key -> its prefix (prefix)
        self._arriving: Prefix | None = None  # the prefix of the request being bound
        # inside: each replica's queue also as a waiting pool of its own, admitted by the pool's rule
        self._own: list[WaitingPool] | None = [WaitingPool() for _ in slots] if inside else None

    def add(self, key: Hashable, vector: np.ndarray | None, now: float, prefix: Prefix | None = None) -> None:
        """As ReplicaRouter.add; `prefix` is the request's prompt text (or chunks), read by "prefix" only."""
        self._arriving = self._prefixes.get(key) if prefix is None else prefix
        super().add(key, vector, now)

    def update(self, key: Hashable, vector: np.ndarray | None) -> None:
        super().update(key, vector)
        if self._own is not None:
            next(own for own in self._own if key in own).update(key, vector)

    def add_replica(self, slots: int) -> int:
        r = super().add_replica(slots)
        if self._own is not None:
            self._own.append(WaitingPool())
        return r

    def set_healthy(self, replica: int, healthy: bool) -> list[Hashable]:
        moved = super().set_healthy(replica, healthy)
        if moved and self._own is not None:  # its queue went to the other replicas' pools
            self._own[replica] = WaitingPool()
        return moved

    def _bind(self, up: np.ndarray) -> int:
        if self.routing == "round-robin":
            return super()._bind(up)
        load = self.load()  # [R]
        if self.routing == "power-of-two":
            return self._two_choices(up, load)
        blocks = prefix_blocks(self._arriving)
        spread = load[up].max() - load[up].min()
        r = None if spread > self.imbalance else self._longest_match(blocks)
        r = self._two_choices(up, load) if r is None else r
        for d in range(1, len(blocks) + 1):  # every block-prefix now maps to r, as the newest entry
            self._served.pop(blocks[:d], None)
            self._served[blocks[:d]] = r
        while len(self._served) > self.prefix_entries:
            del self._served[next(iter(self._served))]
        return r

    def _join(self, r: int, key: Hashable, vector: np.ndarray | None, now: float) -> None:
        super()._join(r, key, vector, now)
        if self._own is not None:
            self._own[r].add(key, vector, now)
        if self.routing == "prefix":
            self._prefixes[key] = self._arriving

    def _leave(self, r: int, key: Hashable, admitted: bool = False) -> np.ndarray | None:
        self._prefixes.pop(key, None)
        if self._own is not None:
            self._own[r].remove(key, admitted=admitted)
        return super()._leave(r, key, admitted)

    def _choose(self, r: int, now: float) -> Hashable:
        if self._own is None:
            return super()._choose(r, now)
        key = self._own[r].pick(self._resident_for(r, self._own[r].size), now, self.max_wait, self.max_passed)
        self.queues[r].remove(key)  # the replica's own queue, by the pool's rule against its own residents
        return key

    def _place(self, key: Hashable, r: int) -> None:
        vector = self._vectors.get(key) if self._own is not None else None
        super()._place(key, r)
        if vector is not None:  # inside: the replica's residents hold it, as affinity's do
            self._resident_for(r, len(vector)).add(vector)
            self.placed[key] = (r, vector)

    def _two_choices(self, up: np.ndarray, load: np.ndarray) -> int:
        """Power of two choices among `up` [H]: the one with fewer requests, ties to the lower index."""
        if len(up) == 1:
            return int(up[0])
        a, b = sorted(int(r) for r in self._rng.choice(up, 2, replace=False))
        return b if load[b] < load[a] else a

    def _longest_match(self, blocks: tuple) -> int | None:
        """The healthy replica last given the longest block-prefix of `blocks`, None when none matches."""
        for d in range(len(blocks), 0, -1):
            r = self._served.get(blocks[:d])
            if r is not None and self.healthy[r]:
                return r
        return None


def prefix_blocks(prefix: Prefix | None) -> tuple:
    """What "prefix" routing compares: a text's first PREFIX_CHARS characters in blocks of PREFIX_BLOCK (the
    last one possibly shorter), a tuple of chunks as it is, None as no blocks."""
    if prefix is None:
        return ()
    if isinstance(prefix, str):
        head = prefix[:PREFIX_CHARS]
        return tuple(head[i:i + PREFIX_BLOCK] for i in range(0, len(head), PREFIX_BLOCK))
    return tuple(prefix)
