"""Which waiting request takes a free slot: the one rule of the proxy, the batch order, the replay and vLLM's queue.

In order:
1. fairness: a request that has waited `max_wait` goes first, the longest-waiting first (ties: the first to join);
   then one that `max_passed` later arrivals have been admitted before goes first, the first to join first. The
   second bound is in admissions, not seconds, so it holds at any speed: no request waits more than `max_passed`
   admissions longer than first come, first served would have made it wait. A request added unbounded (a batch
   line, `admission.wire.BATCH_KEY`: its file is waited on as a whole, not line by line) is under neither bound;
2. a request without a predicted profile keeps first-come-first-served: when it is the oldest
   waiting request it goes, and no request that arrived after it is chosen before it;
3. with nobody resident (who has a profile), the oldest: there is nothing to fit yet;
4. else, among the requests that arrived before the first profile-less one, the one of lowest cost
   to the resident set (`admission.resident.Resident.cost`): with predicted profiles
   (`ResidentExperts`) the fewest expected new experts per step; with embeddings only
   (`ResidentEmbedding`) the nearest to the resident set. Ties go to the earliest arrival.

`WaitingPool` keeps the waiting requests' vectors as rows of one growable matrix [capacity, size],
so a choice is one matrix-vector product over the pool and a few masked reductions: no Python
loop over the waiting requests, whatever their number. The product runs on one BLAS thread: in a
busy server (vLLM's engine process, the proxy beside it) OpenBLAS's threads spin against the
engine's and make one product many times slower (docs/results.md, admission cost).
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import cache

import numpy as np
from threadpoolctl import ThreadpoolController

from moe_cohort.admission.resident import Resident

_LAST = np.iinfo(np.int64).max


@cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()  # inspects the loaded BLAS libraries once


class WaitingPool:
    """Waiting requests by key, each with its vector ([L*E] profile, [D] embedding, or None) and arrival time.

    The first vector added fixes the pool's vector size; a vector of another size counts as none. `bounded`
    False: the request is under neither fairness bound (rule 1).
    """

    def __init__(self, capacity: int = 64) -> None:
        self.size: int | None = None
        self.matrix = np.zeros((0, 0), np.float32)  # [capacity, size] once the size is known
        self.keys: list[Hashable | None] = [None] * capacity
        self.rows: dict[Hashable, int] = {}
        self.active = np.zeros(capacity, bool)  # [capacity]
        self.profiled = np.zeros(capacity, bool)  # [capacity]
        self.arrived = np.zeros(capacity, np.float64)  # [capacity]
        self.seq = np.zeros(capacity, np.int64)  # [capacity] arrival order
        self.passed = np.zeros(capacity, np.int64)  # [capacity] later arrivals admitted while it waited
        self.bounded = np.zeros(capacity, bool)  # [capacity] under the fairness bounds
        self._count = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rows

    def add(self, key: Hashable, vector: np.ndarray | None, arrived: float, bounded: bool = True) -> None:
        if key in self.rows:
            raise ValueError(f"{key!r} is waiting already")
        row = self._free_row()
        self.keys[row], self.rows[key], self.bounded[row] = key, row, bounded
        self.active[row], self.arrived[row], self.seq[row], self.passed[row] = True, arrived, self._count, 0
        self._count += 1
        self.profiled[row] = self._store(row, vector)

    def update(self, key: Hashable, vector: np.ndarray | None) -> None:
        """A new prediction for a waiting request; its place in arrival order is kept."""
        row = self.rows[key]
        self.profiled[row] = self._store(row, vector)

    def remove(self, key: Hashable, admitted: bool = False) -> None:
        """`key` leaves the pool; `admitted`: it took a slot, passing every request that arrived before it."""
        row = self.rows.pop(key)
        if admitted:
            self.passed += self.active & (self.seq < self.seq[row])
        self.keys[row], self.active[row], self.profiled[row] = None, False, False

    def pick(self, resident: Resident | None, now: float, max_wait: float | None,
             max_passed: int | None = None) -> Hashable:
        """The key of the request to admit now, by the rule of the module docstring."""
        if not self.rows:
            raise ValueError("no waiting request to admit")
        overdue = self._overdue(now, max_wait)
        if overdue is None:
            overdue = self._passed_over(max_passed)
        if overdue is not None:
            return self.keys[overdue]
        seq = np.where(self.active, self.seq, _LAST)  # [capacity]
        oldest = int(np.argmin(seq))
        if not self.profiled[oldest] or resident is None or resident.count == 0:
            return self.keys[oldest]
        if resident.size != self.size:
            raise ValueError(f"the resident set holds vectors of {resident.size}, the pool {self.size}")
        first_plain = seq[self.active & ~self.profiled].min(initial=_LAST)
        eligible = self.profiled & (seq < first_plain)  # [capacity]
        return self.keys[self._best(resident, eligible, seq)]

    def _best(self, resident: Resident, eligible: np.ndarray, seq: np.ndarray) -> int:
        rows = int(np.flatnonzero(eligible)[-1]) + 1  # rows past the last eligible one need no cost
        cost = np.full(len(eligible), np.inf)  # [capacity], lower is better
        with _blas().limit(limits=1, user_api="blas"):
            cost[:rows] = resident.cost(self.matrix[:rows])
        cost = np.where(eligible, cost, np.inf)
        best = cost.min()
        ties = eligible & (cost <= best + 1e-9 * max(1.0, abs(best)))
        return int(np.argmin(np.where(ties, seq, _LAST)))

    def _passed_over(self, max_passed: int | None) -> int | None:
        """Row of the first-arrived request passed over `max_passed` times or more, else None."""
        if max_passed is None:
            return None
        over = self.active & self.bounded & (self.passed >= max_passed)  # [capacity]
        return int(np.argmin(np.where(over, self.seq, _LAST))) if over.any() else None

    def _overdue(self, now: float, max_wait: float | None) -> int | None:
        """Row of the longest-waiting request if it waited >= `max_wait` (ties: the earliest arrival), else None."""
        if max_wait is None:
            return None
        arrived = np.where(self.active & self.bounded, self.arrived, np.inf)  # [capacity]
        first = arrived.min()
        if not now - first >= max_wait:  # also when no bounded request waits (first: inf)
            return None
        return int(np.argmin(np.where(arrived == first, self.seq, _LAST)))

    def fit(self, vector: np.ndarray) -> np.ndarray | None:
        """`vector` flat [size] float32 when it has the pool's vector size (the first vector fixes it), else None."""
        vector = np.asarray(vector, np.float32).ravel()
        if self.size is None:
            self.size = vector.shape[0]
            self.matrix = np.zeros((len(self.keys), self.size), np.float32)
        return vector if vector.shape[0] == self.size else None

    def _store(self, row: int, vector: np.ndarray | None) -> bool:
        vector = None if vector is None else self.fit(vector)
        if vector is None:
            return False
        self.matrix[row] = vector
        return True

    def _free_row(self) -> int:
        free = np.flatnonzero(~self.active)
        if len(free):
            return int(free[0])
        old = len(self.keys)  # full: double every per-row array
        self.keys += [None] * old
        self.active, self.profiled, self.bounded = (np.concatenate([a, np.zeros(old, bool)])
                                                    for a in (self.active, self.profiled, self.bounded))
        self.arrived, self.seq = np.concatenate([self.arrived, np.zeros(old)]), np.concatenate([self.seq, np.zeros(old, np.int64)])
        self.passed = np.concatenate([self.passed, np.zeros(old, np.int64)])
        if self.size is not None:
            self.matrix = np.concatenate([self.matrix, np.zeros((old, self.size), np.float32)])
        return old
