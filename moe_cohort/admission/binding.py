"""Where a request that binds on arrival goes: the queue of which replica (admission.router's routings that
bind on arrival). Pure bookkeeping over the replicas' loads; no clock, no I/O.

- "round-robin": the i-th request goes to the i-th healthy replica, in turn.
- "power-of-two" (Ray Serve's default router): two distinct healthy replicas drawn at random,
  `rng.choice(healthy, 2, replace=False)` from the seeded Generator, and the request goes to the one with
  fewer requests (resident + queued), ties to the lower index; with one healthy replica, that one, and
  nothing drawn.
- "prefix" (Ray Serve LLM's PrefixCacheAffinityRouter): the request goes to the replica that was last
  given a request with its longest matching prompt prefix, compared in blocks (`prefix_blocks`: a text's
  first 64 characters in blocks of 16, the last one possibly shorter; or the caller's own tuple of
  chunks). A table maps every block-prefix (the first d blocks, d >= 1) of every routed request to the
  replica it went to, the oldest entries dropped past `prefix_entries`. When the load imbalance (max - min
  of resident + queued over the healthy replicas) exceeds `imbalance`, or no block-prefix of the request
  maps to a healthy replica, it falls back to power-of-two. Only this routing reads the prefix.
"""

from __future__ import annotations

import numpy as np

PREFIX_CHARS, PREFIX_BLOCK = 64, 16  # "prefix": a text's first 64 characters, compared in blocks of 16
Prefix = str | tuple  # a prompt text, or a tuple of hashable chunks


class Binding:
    """One routing's choice of replica for each arriving request; see the module docstring."""

    def __init__(self, routing: str, rng: np.random.Generator, imbalance: int, prefix_entries: int = 1 << 16):
        self.routing, self.imbalance, self.prefix_entries = routing, imbalance, prefix_entries
        self._rng = rng  # power-of-two's draws
        self._turn = 0  # round-robin's
        self._served: dict[tuple, int] = {}  # block-prefix -> the replica last given it, oldest first (prefix)

    def bind(self, up: np.ndarray, load: np.ndarray, healthy: np.ndarray, prefix: Prefix | None = None) -> int:
        """The replica among the healthy `up` [H] whose queue the request joins; `load` [R] resident + queued,
        `healthy` [R]."""
        if self.routing == "round-robin":
            self._turn += 1
            return int(up[(self._turn - 1) % len(up)])
        if self.routing == "power-of-two":
            return self._two_choices(up, load)
        blocks = prefix_blocks(prefix)
        spread = load[up].max() - load[up].min()
        r = None if spread > self.imbalance else self._longest_match(blocks, healthy)
        r = self._two_choices(up, load) if r is None else r
        for d in range(1, len(blocks) + 1):  # every block-prefix now maps to r, as the newest entry
            self._served.pop(blocks[:d], None)
            self._served[blocks[:d]] = r
        while len(self._served) > self.prefix_entries:
            del self._served[next(iter(self._served))]
        return r

    def _two_choices(self, up: np.ndarray, load: np.ndarray) -> int:
        """Power of two choices among `up` [H]: the one with fewer requests, ties to the lower index."""
        if len(up) == 1:
            return int(up[0])
        a, b = sorted(int(r) for r in self._rng.choice(up, 2, replace=False))
        return b if load[b] < load[a] else a

    def _longest_match(self, blocks: tuple, healthy: np.ndarray) -> int | None:
        """The healthy replica last given the longest block-prefix of `blocks`, None when none matches."""
        for d in range(len(blocks), 0, -1):
            r = self._served.get(blocks[:d])
            if r is not None and healthy[r]:
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
