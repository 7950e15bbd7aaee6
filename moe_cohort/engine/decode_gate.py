"""Which prefilled requests decode: one prefill per request, then admission to decode by what the model did with it.

vLLM runs a request's prefill and then decodes it every step until it ends. Under our scheduler with prefill
ahead on, the engine holds more requests in RUNNING than it decodes: `slots` of them decode (the user's
max_num_seqs), and up to `ahead` more have had their prefill and wait, their KV kept, for a decode slot. The
prefill is the request's own (its first token comes out of it), and while it runs the plugin counts which
experts each prompt token picked (engine.prompt_routing): that is the request's profile. When a decode slot
frees, `DecodeGate` admits the held request whose prompt routing best fits the decoding ones, by the one rule
of `admission.waiting.WaitingPool` (fairness bounds first; the fewest expected new experts per step, measured
against the decoding requests' own prompt routing, `admission.resident.ResidentExperts`).

Rules it keeps:
- work-conserving: a decode slot never stays free while a prefilled request waits; a held request whose
  routing has not arrived yet goes first come, first served (the pool's rule for a request without a vector);
- at most `slots` requests decode in a step; a request leaves the gate when it leaves RUNNING (finished,
  aborted, preempted: a preempted one comes back through prefill and is held again);
- a request is prefilled once every token but the last sampled one is computed
  (`num_computed_tokens >= max(num_prompt_tokens, num_tokens - 1)`), which holds for a resumed request too.

Requests are duck-typed (`request_id`, `arrival_time`, `num_computed_tokens`, `num_prompt_tokens`,
`num_tokens`): no vLLM import, so it is tested without an engine; engine.scheduler plugs it in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.waiting import WaitingPool


def prefilled(request) -> bool:
    """Whether the request's prefill (or, resumed, its recompute) is done: only decoding is left."""
    return request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)


class DecodeGate:
    """The RUNNING requests' decode admission; see the module docstring.

    `fallback(request)` gives a profile for a request whose prompt routing never arrives (the proxy's
    prediction in `vllm_xargs.moe_profile`, or None); `bounded(request)` whether the fairness bounds hold for it
    (not for a batch line); `ordered(request)` whether its routing may order it (not for a request that asked for
    first come, first served: it waits as one without a vector); `clock()` is comparable with `arrival_time`.
    """

    def __init__(self, slots: int, *, max_wait_s: float | None = None, max_passed: int | None = None,
                 fallback: Callable[[Any], np.ndarray | None] = lambda request: None,
                 bounded: Callable[[Any], bool] = lambda request: True,
                 ordered: Callable[[Any], bool] = lambda request: True,
                 clock: Callable[[], float] = time.time) -> None:
        if slots < 1:
            raise ValueError(f"a decode gate needs >= 1 slot, got {slots}")
        self.slots, self.max_wait_s, self.max_passed = slots, max_wait_s, max_passed
        self._fallback, self._bounded, self._ordered, self._clock = fallback, bounded, ordered, clock
        self.decoding: dict[str, np.ndarray | None] = {}  # request id -> the vector it joined the residents with
        self.held: dict[str, Any] = {}  # request id -> request, prefilled and waiting for a decode slot
        self._pool = WaitingPool()  # the held requests' vectors, for the choice
        self._routing: dict[str, np.ndarray] = {}  # prompt routing [L*E] that arrived, by request id
        self._resident: ResidentExperts | None = None

    def routed(self, profiles: Mapping[str, np.ndarray]) -> None:
        """Prompt routings [L, E] (fractions of prompt tokens that picked each expert) from the engine's forward."""
        for rid, profile in profiles.items():
            vector = np.asarray(profile, np.float32).ravel()
            self._routing[rid] = vector
            if rid in self.held and self._ordered(self.held[rid]):
                self._pool.update(rid, vector)

    def step(self, running: Iterable[Any]) -> tuple[list[Any], list[Any]]:
        """Before a schedule: bring the gate up to date with RUNNING and fill the free decode slots.
        Returns (admitted now, still held): the held ones must not decode in this step."""
        running = {r.request_id: r for r in running}
        self._forget(running)
        for rid, request in running.items():
            if rid not in self.decoding and rid not in self.held and prefilled(request):
                self._hold(request)
        admitted = []
        now = self._clock()
        while self.held and len(self.decoding) < self.slots:
            admitted.append(self._admit(self._pool.pick(self._residents(), now, self.max_wait_s, self.max_passed)))
        return admitted, list(self.held.values())

    def _forget(self, running: Mapping[str, Any]) -> None:
        for rid in [r for r in self.decoding if r not in running]:
            vector = self.decoding.pop(rid)
            if vector is not None:
                self._resident.remove(vector)
        for rid in [r for r in self.held if r not in running]:
            del self.held[rid]
            self._pool.remove(rid)
        for rid in [r for r in self._routing if r not in running]:
            del self._routing[rid]

    def _hold(self, request) -> None:
        self.held[request.request_id] = request
        self._pool.add(request.request_id, self._vector(request), request.arrival_time, bounded=self._bounded(request))

    def _vector(self, request) -> np.ndarray | None:
        """What a held request is chosen by: its prompt routing, else the fallback; None (first come, first served)
        for one that is not to be ordered."""
        if not self._ordered(request):
            return None
        vector = self._routing.get(request.request_id)
        if vector is None:
            fallback = self._fallback(request)
            vector = None if fallback is None else np.asarray(fallback, np.float32).ravel()
        return vector

    def _admit(self, rid: str):
        row = self._pool.rows[rid]
        vector = self._pool.matrix[row].copy() if self._pool.profiled[row] else None
        self._pool.remove(rid, admitted=True)
        if vector is not None:
            self._residents(len(vector)).add(vector)
        self.decoding[rid] = vector
        return self.held.pop(rid)

    def _residents(self, size: int | None = None) -> ResidentExperts | None:
        """The decoding requests' routing, as one resident set of vectors of `size` (default: the pool's)."""
        size = self._pool.size if size is None else size
        if size is None:
            return None
        if self._resident is None:
            self._resident = ResidentExperts(1, size)
        return self._resident
