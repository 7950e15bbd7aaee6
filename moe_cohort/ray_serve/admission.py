"""What a Ray Serve request router keeps to admit by experts (ray_serve/router.py is the router; this module
imports nothing of Ray). The rules the router keeps, through the one admission router
(admission.router.ReplicaRouter, routing "affinity"):

- A request's text (the call's OpenAI request: a dict, or an object with `messages` / `prompt` such as Ray
  Serve LLM's ChatCompletionRequest) is predicted once, on its first routing attempt (the encoder and its
  profile head, send.profiles; past the predictor's deadline it waits without a profile, first come first
  served, and its profile is filled in when it comes), and it joins one waiting pool.
- Each replica has `slots` slots (its vLLM's max_num_seqs; default: the deployment's max_ongoing_requests).
  A request holds one from the moment it is handed a replica until Serve reports it completed. While no
  replica has a free slot, requests wait in Serve's queue, so that admission has requests to choose from.
- Admission, not only placement: a replica with a free slot takes the waiting request that best fits its own
  residents (fairness bound first: `max_queue_ms`, `max_passed`), whichever request's routing attempt found
  the slot, as Serve's FIFO mixin hands a found replica to the oldest request. When a request completes, its
  replica admits at once; no replica idles while requests wait.
- `choose_replicas` ranks the replicas with free slots, most free first, one per rank; Serve probes them
  in that order and hands the first that accepts to the admission router's choice.
- A replica that Serve adds (scale-up, a replacement) gets a new place in the admission router; one that leaves is
  taken out. Its requests end with errors, which Serve reports as completed, so their slots free.
- `forward_profiles`: the predicted profile goes with the request as `vllm_xargs.moe_profile`, for a
  replica whose vLLM runs our scheduler (engine.scheduler).

Each handle routes with its own router and counts its own requests (as Serve's routers keep their own queue
length caches); behind one ingress deployment of one replica, that is every request.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from moe_cohort.admission.fairness import MAX_WAIT_S
from moe_cohort.admission.router import ReplicaRouter, ResidentFactory
from moe_cohort.admission.wire import PROFILE_KEY, Prediction, with_xargs
from moe_cohort.encoder.text import RequestTextError, request_text


class ServeAdmission:
    """The admission state of one Serve router: Serve's replica ids mapped onto the admission router's indices, the
    requests waiting and placed (by key: Serve's internal request id). Pure bookkeeping, one event loop."""

    def __init__(self, slots: int | None = None, *, max_wait: float | None = MAX_WAIT_S, max_passed: int | None = None,
                 resident_factory: ResidentFactory | None = None) -> None:
        self.slots = slots  # per replica; None: what each replica says (Serve's max_ongoing_requests)
        self._options = dict(max_wait=max_wait, max_passed=max_passed)
        if resident_factory is not None:
            self._options["resident_factory"] = resident_factory
        self.router: ReplicaRouter | None = None  # made with the first replicas
        self.index: dict[Hashable, int] = {}  # replica id -> the admission router's index
        self.ids: list[Hashable] = []  # the admission router's index -> replica id
        self._refused: set[Hashable] = set()  # placed, refused, routed again before the refusal was reported

    def replicas_changed(self, capacity: dict[Hashable, int]) -> None:
        """The replicas now (id -> its own capacity): new ones join the admission router, gone ones are taken out."""
        for rid, own in capacity.items():
            if rid not in self.index:
                self._join(rid, self.slots or own)
        for rid, i in self.index.items():
            if rid not in capacity and self.router.healthy[i]:
                self.router.set_healthy(i, False)

    def arrive(self, key: Hashable, vector: np.ndarray | None, now: float) -> None:
        """A request wants a slot (its first routing attempt, or a retry after a replica refused it)."""
        if key in self.router.placed:  # a retry before its refused attempt was reported completed
            self.router.release(key)
            self._refused.add(key)  # that report frees nothing
        if key not in self.router.pool:
            self.router.add(key, vector, now)

    def predicted(self, key: Hashable, vector: np.ndarray) -> None:
        """A late prediction of a waiting request (its place in the queue kept)."""
        if key in self.router.pool:
            self.router.update(key, vector)

    def leave(self, key: Hashable) -> None:
        """A waiting request that no longer wants a slot (its caller cancelled it)."""
        if key in self.router.pool:
            self.router.remove(key)

    def offer(self, rids: Iterable[Hashable]) -> list[Hashable]:
        """Of `rids`, the replicas with a free slot, most free first (ties: the oldest replica)."""
        free = self.router.free()
        known = [rid for rid in rids if rid in self.index and free[self.index[rid]] > 0]
        return sorted(known, key=lambda rid: (-free[self.index[rid]], self.index[rid]))

    def take(self, rid: Hashable, now: float) -> Hashable | None:
        """The waiting request that a free slot of replica `rid` admits now (placed there), or None."""
        i = self.index.get(rid)
        return None if i is None else self.router.admit_to(i, now)

    def completed(self, rid: Hashable, key: Hashable) -> bool:
        """Request `key` on replica `rid` is done: whether that freed a slot (False for one not placed there)."""
        if key in self._refused:
            self._refused.discard(key)
            return False
        placed = self.router.placed.get(key) if self.router is not None else None
        if placed is None or self.ids[placed[0]] != rid:
            return False
        self.router.release(key)
        return True

    def _join(self, rid: Hashable, slots: int) -> None:
        if self.router is None:
            self.router = ReplicaRouter([slots], "affinity", **self._options)
        else:
            self.router.add_replica(slots)
        self.index[rid] = len(self.ids)
        self.ids.append(rid)


def call_text(args: Sequence[Any], kwargs: dict) -> str | None:
    """The text of a deployment call's OpenAI request (its first argument, or `request=`): a body dict, or an
    object with `messages` / `prompt` / `input`; None when it has none (the request goes first come first served)."""
    request = args[0] if args else kwargs.get("request", kwargs.get("body"))
    if not isinstance(request, dict):
        request = {name: getattr(request, name) for name in ("messages", "prompt") if getattr(request, name, None)}
        if isinstance(request.get("messages"), list):  # pydantic messages (vLLM's protocol) as the dicts they stand for
            request["messages"] = [m.model_dump() if hasattr(m, "model_dump") else m for m in request["messages"]]
    try:
        return request_text(request.get("input") if "input" in request and "messages" not in request else request)
    except RequestTextError:
        return None


def with_profile(request: Any, prediction: Prediction) -> None:
    """Put `prediction`'s compact profile into the request as `vllm_xargs.moe_profile` (a dict body, or an object
    with a `vllm_xargs` field), in place, for an engine that runs our scheduler."""
    if prediction.compact is None:
        return
    if isinstance(request, dict):
        request["vllm_xargs"] = with_xargs(request.get("vllm_xargs"), **{PROFILE_KEY: prediction.compact})
    elif hasattr(request, "vllm_xargs"):
        request.vllm_xargs = with_xargs(request.vllm_xargs, **{PROFILE_KEY: prediction.compact})
