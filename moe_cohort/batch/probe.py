"""Each batch line's prompt routed once by the engine before its turn: the profiles `ExpertOrder` admits by
(fill="as_profiles_arrive").

A probe is a copy of the line's request that asks for one token, not streamed, marked for the expert counts of
moe-cohort's vLLM plugin (send/learning/observed_counts.py). The engine prefills the prompt; the prompt's
counts per layer over its tokens are the line's profile [L, E]: the served model's own routing of this text,
under the line's own routing policy. It predicts the answer's routing far better than a head that reads the
text (docs/results.md, "Probing"), and costs the engine one prefill, whose full blocks vLLM's prefix cache
keeps for the line's own request.

This is the path for an engine that counts experts but does not schedule by them (vLLM's own scheduler with our
plugin): its queue is first come, first served, so a probe sent ahead of a line's request takes the slot that
line would have taken, for one step. The rule that keeps the engine full: no barrier (the first lines go at
once, from the far end of the file: ExpertOrder), and PROBE_CONCURRENCY probes at once, so a slot that frees
serves at most that many probes before the next line. Lines are probed in file order, each once, while fewer than
PROBE_AHEAD probed lines wait; a line already sent is skipped. A probe that fails (an error answer, counts that
never come) leaves its line without a profile: it is sent like any other, and its own request says what is wrong;
once one finds the backend unreachable, no more are sent. Chat and completions lines are probed; other lines go
without.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.core import RunStats
from moe_cohort.batch.format import BatchRequest
from moe_cohort.batch.order import AS_PROFILES_ARRIVE, DEFAULT_WINDOW, ExpertOrder
from moe_cohort.batch.probe_request import probe_body, prompt_profile
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendUnreachable, ServiceError
from moe_cohort.send.learning.observed_counts import ObservedCounts
from moe_cohort.traces.observed import Observed

log = logging.getLogger(__name__)

PROBED_URLS = ("/v1/chat/completions", "/v1/completions")
COUNTS_WAIT_S = 5.0  # after the last probe, how long its counts are waited for
COUNTS_POLL_S = 0.05  # how often the counts of answered probes are asked for: a line waits for its profile only so long
# the most probed lines that wait: admission chooses among as many as ExpertOrder looks ahead over (the whole of a
# smaller file), and on a file of any size the pool (what each choice scans) and the prompts vLLM's prefix cache
# must keep until their lines go stay bounded
PROBE_AHEAD = DEFAULT_WINDOW
PROBE_CONCURRENCY = 1  # probes at the engine at once (see above: each may take a freed slot from a line for a step)
ROOM_POLL_S = 0.05  # how often a probe that waits for room asks again


class Probes:
    """Probes the lines of a run on `client`, `concurrency` at a time; `found(line, prediction)` gets each profile."""

    def __init__(self, client: BackendClient, concurrency: int, found: Callable[[int, Prediction], None],
                 headers: dict[str, str] | None = None) -> None:
        self.client, self.concurrency, self.headers = client, concurrency, headers or {}
        self.counts = ObservedCounts([client], self._deliver, poll_s=COUNTS_POLL_S)
        self._found = found
        self.unreachable = False  # a probe found no backend: the others are not sent

    async def run(self, requests: Sequence[BatchRequest], sent: Callable[[int], bool],
                  room: Callable[[], bool] = lambda: True) -> None:
        """Probe `requests` in order, skipping lines `sent` says went already, each once `room()` says so (checked
        every ROOM_POLL_S); returns once every profile came (or COUNTS_WAIT_S after the last probe answered)."""
        free = asyncio.Semaphore(self.concurrency)
        try:
            async with asyncio.TaskGroup() as tg:
                for request in requests:
                    if request.url not in PROBED_URLS:
                        continue
                    await free.acquire()
                    while not room():
                        await asyncio.sleep(ROOM_POLL_S)
                    if self.unreachable:  # the run finds out for itself, and says so
                        free.release()
                        break
                    if sent(request.line):
                        free.release()
                        continue
                    tg.create_task(self._probe(request, free))
            await self.counts.flush(COUNTS_WAIT_S)
        finally:
            self.counts.close()

    async def _probe(self, request: BatchRequest, free: asyncio.Semaphore) -> None:
        body = probe_body(request.body)
        self.counts.mark(body, kept=True)
        try:
            await self.client.request("POST", request.url, json=body, headers=self.headers)
        except BackendUnreachable as exc:  # no probe more: the run's own requests retry, then stop it
            self.unreachable = True
            log.debug("the probe of line %d found no backend: %s", request.line, exc)
        except ServiceError as exc:  # the line goes without a profile; its own request reports the error
            log.debug("the probe of line %d failed: %s", request.line, exc)
        else:
            self.counts.finished(self.client, body, str(request.line))  # the counts come back under the line
        finally:
            free.release()

    def _deliver(self, line: str, counts: Observed, kept: bool) -> None:
        self._found(int(line), Prediction.of_profile(prompt_profile(counts)))


def probed_order(pending: Sequence[BatchRequest], client: BackendClient, stats: RunStats, max_in_flight: int,
                 headers: dict[str, str]) -> tuple[ExpertOrder, Callable[[], Awaitable[None]]]:
    """A probing run's order and the task that probes the `pending` lines while the run goes (PROBE_CONCURRENCY at a
    time, while fewer than PROBE_AHEAD probed lines wait). `stats.probed` counts the profiles found."""
    order = ExpertOrder(max_in_flight, fill=AS_PROFILES_ARRIVE)
    stats.probed = 0

    def found(line: int, prediction: Prediction) -> None:
        stats.probed += 1
        order.predicted({line: prediction})

    probes = Probes(client, PROBE_CONCURRENCY, found, headers)
    return order, lambda: probes.run(pending, order.out, lambda: order.router.waiting() < PROBE_AHEAD)
