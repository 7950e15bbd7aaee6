"""One request at the backend, from its turn to its end, written once for every path that sends one.

    admit -> send (whole, or the stream opened) -> fail over -> observed -> release

The chat, completions and responses routes (whole or streamed) and each line of a batch file go through a
`Lifecycle`. Its rules:

- The slot is released exactly once, however the request ends: answered, failed, or cancelled because the
  client left (`close()` is idempotent and runs on every exit).
- A request goes to another replica only when its own is down and generated nothing of it
  (`send.replicas.ReplicaSet.failover`); it keeps its arrival, so its place in the fairness bound.
- What is forwarded: the client's body with the predicted profile (`vllm_xargs.moe_profile`, for an engine
  that reorders its own queue) and its `x-cohort-key` header; with learning, the body marked for the
  engine to count its experts.
- Learning hears of the request once, when it leaves the replica that had it (not one found down), and
  learns from vLLM's routed experts in a whole answer (`observed`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from moe_cohort.admission.wire import PROFILE_KEY, with_xargs
from moe_cohort.send.backend_client import BackendAnswer, BackendClient
from moe_cohort.send.cohort_key import cohort_key_header
from moe_cohort.send.errors import BackendUnreachable
from moe_cohort.send.gate import AdmissionGate
from moe_cohort.send.learning.learning import Learning
from moe_cohort.send.learning.observed_counts import client_answer
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import Slot

T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    """A whole answer as the client gets it (the HTTP layer makes it a response)."""

    content: bytes
    status_code: int
    content_type: str
    headers: dict[str, str]  # X-Cohort-Admission, X-Cohort-Queue-Ms, Server-Timing


class Lifecycle:
    """One request (`body` to POST at `path`; `text`: what the encoder reads) from its turn to its end.

    `async with Lifecycle(...) as life:` admits it on entry (a background slot with `background`) and
    closes it on exit; a stream calls `admit()`, `open_stream()` and `close()` itself, since its answer
    outlives the handler."""

    def __init__(self, gate: AdmissionGate, path: str, body: dict, text: str, headers: dict[str, str], *,
                 learning: Learning | None = None, background: bool = False, route: str = "batch",
                 metrics: Metrics | None = None, started: float | None = None,
                 profile: list[int] | None = None) -> None:
        self.gate, self.path, self.text, self.headers = gate, path, text, headers
        self.profile = profile  # the compact profile predicted before the gate (a batch's order) to forward
        self.learning, self.background = learning, background
        self.route, self.metrics = route, metrics or gate.metrics  # the metrics' label and registry
        self.started = started  # when the request arrived (perf_counter): the proxy's own time is counted from it
        self.body = dict(body)
        if learning is not None:
            learning.sending(self.body)  # when sampled, the engine counts this request's experts
        self.slot: Slot | None = None  # the slot held (None before admission, between replicas, after close)
        self.granted: Slot | None = None  # the last slot granted, kept after close (the response's headers)
        self.backend_s = 0.0  # time at the backend until the answer (or the stream's status line), every replica
        self._at: BackendClient | None = None  # the replica that has the request, for learning
        self._stream: contextlib.AbstractAsyncContextManager | None = None

    async def __aenter__(self) -> Lifecycle:
        await self.admit()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def admit(self) -> Slot:
        """Wait for this request's turn (the gate's admission, or a background slot)."""
        self.slot = self.granted = await (self.gate.admit_background() if self.background
                                          else self.gate.admit(self.text))
        return self.slot

    async def whole(self) -> Reply:
        """The client's answer to a whole (not streamed) request: admitted, sent, answered, released. Cancelling
        it (the client left) closes the backend connection, which makes vLLM abort the request."""
        async with self:
            with self.metrics.backend_seconds.labels(self.route).time():
                answer = await self.answer()
        return Reply(self.observed(answer.content), answer.status_code, answer.content_type, self.response_headers())

    def response_headers(self) -> dict[str, str]:
        """X-Cohort-Admission (the slot's number in admission order), X-Cohort-Queue-Ms, and a Server-Timing
        header (W3C) when the arrival is known: the proxy's own time, the wait for a slot, the backend's.
        The proxy's own time (arrival to now, less the wait and the backend) is observed in the metrics."""
        slot = self.granted
        headers = {"x-cohort-admission": slot.id, "x-cohort-queue-ms": f"{slot.queue_s * 1000:.1f}"}
        if self.started is not None:
            own = max(0.0, time.perf_counter() - self.started - slot.wait_s - self.backend_s)
            headers["server-timing"] = (f"proxy;dur={own * 1000:.3f}, queue;dur={slot.wait_s * 1000:.3f}, "
                                        f"backend;dur={self.backend_s * 1000:.3f}")
            self.metrics.own_seconds.labels(self.route).observe(own)
        return headers

    async def answer(self) -> BackendAnswer:
        """The backend's whole answer; BackendStatusError for 4xx/5xx."""
        return await self._on_a_replica(lambda slot: slot.client.request(
            "POST", self.path, json=self._body(slot), headers=self._headers(slot)))

    def observed(self, content: bytes) -> bytes:
        """A 200 answer's content as the client gets it: its routed experts learned from, when sampled, and
        stripped unless the client asked for them."""
        if self.learning is None:
            return client_answer(content, self.body)[0]
        return self.learning.answered(content, self.body, self.text)

    async def open_stream(self):
        """Open the streamed answer on the held slot's replica (raises on a backend error status); the
        response's bytes come from `self.slot.client.iter_raw(response)`; `close()` closes it."""
        async def opened(slot: Slot):
            stream = slot.client.stream(self.path, json=self._body(slot), headers=self._headers(slot))
            response = await stream.__aenter__()
            self._stream = stream
            return response
        return await self._on_a_replica(opened)

    async def close(self) -> None:
        """End the request: close its stream (vLLM aborts a request whose connection closes), tell learning,
        release the slot. Runs once; later calls do nothing."""
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.__aexit__(None, None, None)
        slot, self.slot = self.slot, None
        if slot is None:
            return
        if self.learning is not None and self._at is not None:
            self.learning.left(self._at, self.body, self.text)
        self.gate.release(slot)

    async def _on_a_replica(self, send: Callable[[Slot], Awaitable[T]]) -> T:
        """`send(slot)` on the held slot; when its replica is down and generated nothing, again on another."""
        while True:
            slot, sent = self.slot, time.perf_counter()
            self._at = slot.client
            try:
                return await send(slot)
            except BackendUnreachable as exc:
                self.backend_s += time.perf_counter() - sent
                sent = None
                self._at = None  # not reached, or down: it has no counts of this request to give
                if not await self.gate.failover(slot, exc):  # its replica may be generating it: never resent
                    raise
                self.slot = None
                self.gate.release(slot)
                self.slot = self.granted = await self.gate.readmit(slot)
            finally:
                if sent is not None:
                    self.backend_s += time.perf_counter() - sent

    def _body(self, slot: Slot) -> dict:
        compact = self.profile if slot.prediction is None else slot.prediction.compact
        if compact is None:
            return self.body
        return {**self.body, "vllm_xargs": with_xargs(self.body.get("vllm_xargs"), **{PROFILE_KEY: compact})}

    def _headers(self, slot: Slot) -> dict[str, str]:
        return {**self.headers, **cohort_key_header(slot.prediction)}
