"""Which request of a batch file goes to the backend next: file order, or admission by predicted experts.

A batch run keeps `concurrency` requests (the backend's max_num_seqs) at the backend; whenever one
finishes, the next is chosen from everything still waiting. `ExpertOrder` chooses as the proxy's
online admission does (`admission.waiting.WaitingPool`): the waiting request expected to add the
fewest experts per step to the requests out now (predicted profiles, or nearest embedding
without a profile head), among the first `window` waiting ones in file order, so the choice
stays cheap, and the pool's memory bounded, on files of any size. An order is pure (no I/O, no asyncio): `BatchCore` calls `pick`
with its waiting requests and tells it what it `sent` and what `finished`.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence

import numpy as np

from moe_cohort.admission.waiting import WaitingPool
from moe_cohort.proxy.batch.format import BatchRequest
from moe_cohort.proxy.profiles import Predictor

DEFAULT_WINDOW = 1024


class Order(Protocol):
    def pick(self, waiting: Sequence[BatchRequest]) -> int: ...
    def sent(self, request: BatchRequest) -> None: ...
    def finished(self, request: BatchRequest) -> None: ...


class FileOrder:
    """The file's order (what `--encoder none` gives)."""

    def pick(self, waiting: Sequence[BatchRequest]) -> int:
        return 0

    def sent(self, request: BatchRequest) -> None:
        pass

    def finished(self, request: BatchRequest) -> None:
        pass


class ExpertOrder:
    """Admission by predicted experts over the waiting requests; `vectors` by input line ([L*E] or [D], or None)."""

    def __init__(self, vectors: dict[int, np.ndarray | None], resident_factory: Callable[[int], object], *,
                 window: int = DEFAULT_WINDOW) -> None:
        self.vectors, self.window = vectors, window
        size = next((v.shape[0] for v in vectors.values() if v is not None), None)
        self.resident = None if size is None else resident_factory(size)
        self.pool = WaitingPool()  # the first `window` waiting requests, keyed by input line

    def pick(self, waiting: Sequence[BatchRequest]) -> int:
        for r in waiting[len(self.pool): self.window]:  # top the pool up from the file (waiting keeps file order)
            if r.line not in self.pool:
                self.pool.add(r.line, self.vectors.get(r.line), 0.0)
        line = self.pool.pick(self.resident, 0.0, None)
        return next(i for i, r in enumerate(waiting[: self.window]) if r.line == line)

    def sent(self, request: BatchRequest) -> None:
        if request.line in self.pool:
            self.pool.remove(request.line)
        if self.vectors.get(request.line) is not None:
            self.resident.admit(self.vectors[request.line])

    def finished(self, request: BatchRequest) -> None:
        if self.vectors.get(request.line) is not None:
            self.resident.release(self.vectors[request.line])


def make_order(requests: Sequence[BatchRequest], predictor: Predictor | None, *, window: int = DEFAULT_WINDOW) -> Order:
    """Admission by `predictor`'s vectors of `requests` (predicted once, here), or file order without one."""
    if predictor is None:
        return FileOrder()
    predicted = predictor.predict([r.text for r in requests])
    vectors = {r.line: (None if p is None else p[0]) for r, p in zip(requests, predicted)}
    return ExpertOrder(vectors, predictor.resident_factory, window=window)


def simulated_order(requests: Sequence[BatchRequest], order: Order, concurrency: int) -> list[BatchRequest]:
    """The order `order` would send `requests` in if they finished first in, first out (`--dry-run`)."""
    waiting, out, sent = list(requests), deque(), []
    while waiting:
        if len(out) >= concurrency:
            order.finished(out.popleft())
        request = waiting.pop(order.pick(waiting))
        order.sent(request)
        out.append(request)
        sent.append(request)
    return sent
