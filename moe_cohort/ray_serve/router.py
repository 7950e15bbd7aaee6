"""Expert-aware admission and routing as a Ray Serve request router: what the proxy's gate does in front of
vLLM, inside a Ray Serve deployment (Ray Serve LLM's LLMServer, or any deployment whose calls carry an
OpenAI request). Configured per deployment:

    deployment_config={"request_router_config": {
        "request_router_class": "moe_cohort.ray_serve.router:ExpertAffinityRouter",
        "request_router_kwargs": {"slots": 32, "encoder": "static"}}}

`request_router_kwargs` (`ExpertAffinityRouter.initialize_state`): `slots` (each replica's vLLM
max_num_seqs; default the deployment's max_ongoing_requests), `encoder` (a name or path as `cohort serve
--encoder`, a `cohort train` folder with its profile head), `head` (a folder holding a profile head that
wins over the encoder's, such as a proxy's `--data-dir`/learned), `max_queue_ms` and `max_passed` (the
fairness bound; `max_passed` 0: 3 x `slots`, as `cohort serve`), `forward_profiles`. The rules it keeps are in ray_serve/admission.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

try:
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as exc:  # without Ray this module imports nothing and says how to install it
    raise ImportError(f"the Ray Serve router needs Ray Serve: pip install 'moe-cohort[ray]' ({exc})") from exc

from moe_cohort.admission.fairness import MAX_WAIT_S, PASSED_PER_SLOT
from moe_cohort.admission.wire import Prediction
from moe_cohort.ray_serve.admission import ServeAdmission, call_text, with_profile
from moe_cohort.send.gate import Profiler
from moe_cohort.send.profiles import FixedHead, make_predictor
from moe_cohort.send.settings import DEFAULT_ENCODER, Settings

log = logging.getLogger(__name__)


class ExpertAffinityRouter(RequestRouter):
    """Ray Serve's request router interface (`choose_replicas`, `on_request_completed`, ...) over a
    `ServeAdmission`; see this module's and ray_serve/admission.py's docstrings."""

    def initialize_state(self, slots: int | None = None, encoder: str = DEFAULT_ENCODER, head: str | None = None,
                         max_queue_ms: float = MAX_WAIT_S * 1000, max_passed: int = 0, forward_profiles: bool = False) -> None:
        settings = Settings(encoder=encoder, max_queue_ms=max_queue_ms, max_passed=max_passed)
        predictor = make_predictor(settings)
        if predictor is not None and head:
            predictor.follow(FixedHead.from_folder(head))
        self._predictor, self._forward = predictor, forward_profiles
        self._profiler = None if predictor is None else Profiler(predictor.predict, ready=predictor.ready)
        passed = max_passed or (PASSED_PER_SLOT * slots if slots else None)  # 0: as the proxy's default
        self._book = ServeAdmission(slots, max_wait=max_queue_ms / 1000, max_passed=passed,
                                    resident_factory=None if predictor is None else predictor.resident_factory)
        self._waiting: dict[str, PendingRequest] = {}  # key -> the request, until handed a replica
        self._predictions: dict[str, Prediction] = {}  # key -> its prediction, until handed a replica
        self._arriving: dict[str, asyncio.Future] = {}  # key -> its first routing attempt's arrival, under way

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._book.replicas_changed({r.replica_id: r.max_ongoing_requests for r in replicas})
        for r in replicas:  # new room: waiting requests take it at once
            self._admit(r)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            await self._arrive(pending_request)
            pending_request.routing_context.should_backoff = True  # no free slot: Serve waits before asking again
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in self._book.offer(by_id)]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Serve found `replica` accepting: it takes the waiting request the admission router chooses for it."""
        self._admit(replica, at_most=1)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._book.completed(replica_id, internal_request_id) and replica_id in self._replicas:
            self._admit(self._replicas[replica_id])  # its slot frees: that replica admits at once

    async def _arrive(self, pr: PendingRequest) -> None:
        """The request joins the waiting pool once per attempt, with its prediction (or without, past the deadline)."""
        key = pr.metadata.internal_request_id
        if key in self._waiting:
            return
        if key in self._arriving:
            await asyncio.shield(self._arriving[key])
            return
        self._arriving[key] = asyncio.get_running_loop().create_future()
        try:
            prediction = await self._predict(key, pr)
            self._waiting[key] = pr
            self._book.arrive(key, None if prediction is None else prediction.vector,
                              time.monotonic() - (time.time() - pr.created_at))
        finally:
            self._arriving.pop(key).set_result(None)

    async def _predict(self, key: str, pr: PendingRequest) -> Prediction | None:
        """The request's prediction within the predictor's deadline; a later one fills it in while it waits."""
        text = call_text(pr.args, pr.kwargs)
        if self._profiler is None or text is None or not self._profiler.ready():
            return None
        predicting = asyncio.ensure_future(self._profiler.profile(text))
        try:
            prediction = await asyncio.wait_for(asyncio.shield(predicting), self._predictor.deadline_s)
        except TimeoutError:
            predicting.add_done_callback(lambda done: self._late(key, done))
            return None
        if prediction is not None:
            self._predictions[key] = prediction
        return prediction

    def _late(self, key: str, done: asyncio.Future) -> None:
        prediction = None if done.cancelled() or done.exception() else done.result()
        if prediction is not None and key in self._waiting:
            self._predictions[key] = prediction
            self._book.predicted(key, prediction.vector)

    def _admit(self, replica: RunningReplica, at_most: int | None = None) -> None:
        """Hand `replica`'s free slots (at most `at_most`) to the waiting requests the admission router picks for it."""
        handed = 0
        while at_most is None or handed < at_most:
            key = self._book.take(replica.replica_id, time.monotonic())
            if key is None:
                return
            pr = self._waiting.pop(key)
            prediction = self._predictions.pop(key, None)
            if pr.future.done():  # its caller left meanwhile: the slot goes to the next
                self._book.completed(replica.replica_id, key)
                continue
            if self._forward and prediction is not None and pr.args:
                with_profile(pr.args[0], prediction)
            self._cancel_routing_task_for_pending_request(pr)
            self._record_queue_wait_time(pr)
            pr.future.set_result(replica)
            self._remove_pending_request_from_indices(pr)
            handed += 1
