"""vLLM's waiting queue, reordered by predicted experts: the engine-side admission of moe-cohort.

vLLM's scheduler admits waiting requests into free slots (up to max_num_seqs) by peeking at
the front of its waiting queue and popping it once it fits. `ExpertAwareQueue` implements the
whole request-queue contract of vLLM's `RequestQueue` (add, pop, peek, prepend, remove, bool,
len, iter), but its front is chosen, not fixed: among the waiting requests that carry a
predicted expert profile, the one expected to add the fewest experts per step to the running
set, by the rule of `admission.waiting.WaitingPool` (which the proxy's pool uses too: fairness
bound first, FCFS for requests without a profile). The rest of vLLM's semantics are kept:

- requests put back at the front (preempted ones, ones skipped in a scheduling pass) stay in
  front, in vLLM's order, before any choice;
- `pop_request` returns what `peek_request` showed (the scheduler peeks, checks, then pops).

It is the one front-end that does not go through `admission.router.ReplicaRouter` (the proxy, the
batch order and the replay do): the router owns the slots and places a request when it chooses it,
while here vLLM owns both. Its scheduler may peek and not pop (the KV budget), preempts running
requests back into the queue, and decides alone what runs, so this queue keeps the router's two
parts and nothing else: the same `WaitingPool` (the rule) and a `ResidentExperts` rebuilt from
vLLM's running list before each choice.

The profile travels in the request's `vllm_xargs` as `moe_profile`: the compact form of
`admission.wire` (per MoE layer its `COMPACT_TOP` most frequent experts, one int
`expert * 256 + round(255 * u)` each, layer after layer). This module
imports no vLLM: requests are duck-typed (`request_id`, `arrival_time`,
`sampling_params.extra_args`), so it is tested without an engine; engine/scheduler.py plugs it in.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.waiting import WaitingPool
from moe_cohort.admission.wire import BATCH_KEY, COMPACT_TOP, FCFS_KEY, PROFILE_KEY, decode_profile

log = logging.getLogger(__name__)


def batch_line(request) -> bool:
    """Whether the request is a batch line (`vllm_xargs.moe_batch`): chosen under neither fairness bound."""
    return _extra(request).get(BATCH_KEY) == 1  # vLLM's API makes a JSON true 1 (vllm_xargs holds str, int, float)


def first_come(request) -> bool:
    """Whether the request asks to be admitted first come, first served (`vllm_xargs.moe_fcfs`)."""
    return _extra(request).get(FCFS_KEY) == 1


def _extra(request) -> dict:
    return getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}


def profile_of(request, num_experts: int) -> np.ndarray | None:
    """The request's decoded profile, or None when it sent none (no key, or null: a table of requests, such as a Ray
    Dataset's, fills a key some rows lack with null) or a malformed one (logged)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    if extra.get(PROFILE_KEY) is None:
        return None
    profile = decode_profile(extra[PROFILE_KEY], num_experts)
    if profile is None:
        log.warning("request %s: vllm_xargs.%s must be a list of %d ints per MoE layer, expert * 256 + level, with "
                    "experts below %d (admission.wire.compact); admitting it first come, first served",
                    request.request_id, PROFILE_KEY, COMPACT_TOP, num_experts)
    return profile


class ExpertAwareQueue:
    """A waiting queue whose front is the request that best fits the running set (see the module doc).

    `running()` returns the scheduler's running requests (read on every choice); `num_experts` is
    the model's routed experts per layer; `clock()` is comparable with the requests'
    `arrival_time` (vLLM: time.time()).
    """

    def __init__(self, running: Callable[[], Sequence[Any]], num_experts: int, *, max_wait_s: float = 30.0,
                 max_passed: int | None = None, clock: Callable[[], float] = time.time):
        self._running, self.num_experts, self.max_wait_s, self._clock = running, num_experts, max_wait_s, clock
        self.max_passed = max_passed  # admission.waiting: admissions a request may be passed over by
        self._front: deque = deque()  # put back by the scheduler; served first, in order
        self._pool: dict[str, Any] = {}  # request_id -> request, in arrival order
        self._waiting = WaitingPool()  # the same requests' profiles, for the choice
        self._res: ResidentExperts | None = None  # the running requests' profiles ...
        self._res_profiles: dict[str, np.ndarray] = {}  # ... of these request ids
        self._profiles: dict[str, np.ndarray | None] = {}  # request_id -> [L*E] or None
        self._choice: tuple[tuple, float, Any] | None = None  # (running ids, valid until, request) of the last peek

    # --- the RequestQueue contract -------------------------------------------------------
    def add_request(self, request) -> None:
        self._pool[request.request_id] = request
        self._waiting.add(request.request_id, self._profile(request), request.arrival_time,
                          bounded=not batch_line(request))
        self._remember(request)

    def pop_request(self):
        """The request the last peek showed, if nothing changed since; else a fresh choice."""
        if self._front:
            return self._front.popleft()
        fresh = self._choice is not None and self._choice[0] == self._state_key()
        request = self._choice[2] if fresh else self.peek_request()
        self._discard(request, admitted=True)
        return request

    def peek_request(self):
        if self._front:
            return self._front[0]
        if not self._pool:
            raise IndexError("peek from an empty queue")
        key = self._state_key()
        if self._choice is None or self._choice[0] != key or self._clock() >= self._choice[1]:
            self._choice = (key, self._next_deadline(), self._choose())
        return self._choice[2]

    def prepend_request(self, request) -> None:
        self._front.appendleft(request)
        self._remember(request)

    def prepend_requests(self, requests: Iterable) -> None:
        """Like vLLM's FCFS queue: each is put in front in turn (so the last given ends up first)."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request) -> None:
        if request.request_id not in self._pool and request not in self._front:
            raise ValueError(f"request {request.request_id} is not in the queue")
        self._discard(request)

    def remove_requests(self, requests: Iterable) -> None:
        for request in list(requests):
            self._discard(request)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._pool)

    def __len__(self) -> int:
        return len(self._front) + len(self._pool)

    def __iter__(self) -> Iterator:
        """Front first, then arrival order (vLLM iterates the queue for stats and aborts)."""
        yield from list(self._front)
        yield from list(self._pool.values())

    # --- the choice ----------------------------------------------------------------------
    def _choose(self):
        resident = self._resident(self._waiting.size) if self._waiting.size else None
        return self._pool[self._waiting.pick(resident, self._clock(), self.max_wait_s, self.max_passed)]

    def _resident(self, size: int) -> ResidentExperts:
        """The running requests' predicted experts (those with a profile of `size`), kept up to date by
        adding the newly running and removing the gone since the last choice."""
        running = {r.request_id: r for r in self._running()}
        if self._res is None or self._res.size != size:
            self._res, self._res_profiles = ResidentExperts(1, size), {}
        for rid in set(self._res_profiles) - running.keys():
            self._res.remove(self._res_profiles.pop(rid))
        for rid in running.keys() - self._res_profiles.keys():
            profile = self._profile(running[rid])
            if profile is not None and profile.shape[0] == size:
                self._res.add(profile)
                self._res_profiles[rid] = profile
        return self._res

    def _profile(self, request) -> np.ndarray | None:
        """Cached decoded profile (the cache forgets requests that are neither queued nor running)."""
        if request.request_id not in self._profiles:
            self._profiles[request.request_id] = profile_of(request, self.num_experts)
            self._forget_finished()
        return self._profiles[request.request_id]

    def _forget_finished(self) -> None:
        if len(self._profiles) > 2 * (len(self) + len(self._running())) + 64:
            alive = {r.request_id for r in (*self, *self._running())}
            self._profiles = {k: v for k, v in self._profiles.items() if k in alive}

    def _next_deadline(self) -> float:
        """When the oldest queued request becomes overdue (a cached choice is stale from then on)."""
        return float(self._waiting.arrived[self._waiting.active].min()) + self.max_wait_s

    def _state_key(self) -> tuple:
        """What a choice depends on besides the pool, which every mutation already resets."""
        return tuple(r.request_id for r in self._running())

    def _remember(self, request) -> None:
        self._profile(request)
        self._choice = None

    def _discard(self, request, admitted: bool = False) -> None:
        if self._pool.pop(request.request_id, None) is not None:
            self._waiting.remove(request.request_id, admitted)
        if request in self._front:
            self._front.remove(request)
        self._choice = None
