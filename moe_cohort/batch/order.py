"""Which request of a batch file goes to the backend next: file order, a spread draw, admission by predicted experts, or
admission by the engine's own routing of each prompt (`ExpertOrder` filled as profiles arrive, fed by batch/probe.py).

A batch run keeps `max_in_flight` requests (the backend's max_num_seqs) at the backend; whenever one
finishes, the next is chosen from everything still waiting. `ExpertOrder` is the proxy's online
admission in one replica of `max_in_flight` slots: the same `admission.router.ReplicaRouter` (the
oldest while nothing is out, else the waiting request expected to add the fewest experts per step to
the requests out now: predicted profiles, or nearest embedding without a profile head; FCFS for a
request without a vector; ties to file order), over the first `window` waiting requests in file
order, so the choice stays cheap, and the pool's memory bounded, on files of any size. An order is
pure (no I/O, no asyncio): `BatchCore` calls `pick` with its waiting requests and tells it what it
`sent` and what `finished`.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Iterable, Literal, Protocol, Sequence

import numpy as np

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.router import ReplicaRouter, ResidentFactory
from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.format import BatchRequest
from moe_cohort.send.profiles import Predictor

DEFAULT_WINDOW = 1024


class Order(Protocol):
    def pick(self, waiting: Sequence[BatchRequest]) -> int: ...
    def sent(self, request: BatchRequest) -> None: ...
    def finished(self, request: BatchRequest) -> None: ...
    def compact(self, line: int) -> list[int] | None: ...  # the line's predicted profile as forwarded, if any


class FileOrder:
    """The file's order (what `--encoder none` gives)."""

    def pick(self, waiting: Sequence[BatchRequest]) -> int:
        return 0

    def sent(self, request: BatchRequest) -> None:
        pass

    def finished(self, request: BatchRequest) -> None:
        pass

    def compact(self, line: int) -> list[int] | None:
        return None


class SpreadOrder(FileOrder):
    """The waiting requests in a seeded random permutation of `lines`: the first n sent are a uniform sample of
    the file (of what an earlier run left), whatever n turns out to be."""

    def __init__(self, lines: Iterable[int], seed: int = 0) -> None:
        order = list(lines)
        random.Random(seed).shuffle(order)
        self.rank = {line: i for i, line in enumerate(order)}

    def pick(self, waiting: Sequence[BatchRequest]) -> int:
        return min(range(len(waiting)), key=lambda i: self.rank.get(waiting[i].line, len(self.rank)))


AHEAD, AS_PROFILES_ARRIVE = "ahead", "as_profiles_arrive"
Fill = Literal["ahead", "as_profiles_arrive"]


class ExpertOrder:
    """Admission by expert profiles over the waiting requests, through a ReplicaRouter of one replica of
    `max_in_flight` slots: a slot that frees takes the pooled line expected to add the fewest experts to the lines
    out now. The caller sends at most `max_in_flight` requests at once, each the one `pick` chose, and reports each
    `finished` one. `fill` says how the waiting pool fills:

    - "ahead": profiles predicted up front (`vectors`, or `predicted`) by input line ([L*E] or [D], or None); the
      pool is topped up from the first `window` waiting requests in file order, a request without a vector FCFS;
      a newer prediction re-scores a pooled line in place;
    - "as_profiles_arrive": profiles that come while the run goes (batch/probe.py: the engine's routing of each
      prompt); a line joins the pool when its profile comes (its first one only). Work-conserving: while no pooled
      line waits, a slot takes the LAST waiting line of the file (the probes go from the first, so they do not race
      the lines sent without one). A profile that comes for a line already out joins the resident set until that
      line finishes; one for a line finished is dropped."""

    def __init__(self, max_in_flight: int,
                 resident_factory: ResidentFactory = lambda size: ResidentExperts(1, size), *,
                 fill: Fill = AHEAD, window: int = DEFAULT_WINDOW,
                 vectors: dict[int, np.ndarray | None] | None = None) -> None:
        if fill not in (AHEAD, AS_PROFILES_ARRIVE):
            raise ValueError(f"fill is {AHEAD!r} or {AS_PROFILES_ARRIVE!r}, got {fill!r}")
        self.fill, self.window = fill, window
        self.vectors: dict[int, np.ndarray | None] = dict(vectors or {})  # "ahead": by input line, pooled or not
        self.compacts: dict[int, list[int] | None] = {}  # by input line: the profile as forwarded
        self.router = ReplicaRouter([max_in_flight], "affinity", resident_factory=resident_factory)
        self._chosen: deque[int] = deque()  # lines the router admitted that were not sent yet, in its order
        self._done: set[int] = set()  # lines finished ("as_profiles_arrive": a late profile of theirs is dropped)

    @classmethod
    def taking_over(cls, predictions: dict[int, Prediction | None], out: dict[int, Prediction | None],
                    resident_factory: ResidentFactory, max_in_flight: int, *, window: int = DEFAULT_WINDOW) -> ExpertOrder:
        """The order ("ahead") of the waiting lines' `predictions` from now on, while the lines in `out` (sent by an
        earlier order, not finished) stay at the backend: they hold their slots, and their predictions count as
        residents."""
        order = cls(max_in_flight, resident_factory, window=window)
        order.predicted({**predictions, **out})
        for line, prediction in out.items():
            order.router.hold(line, 0)
            if prediction is not None:
                order.router.assign(line, prediction.vector)
        return order

    def compact(self, line: int) -> list[int] | None:
        return self.compacts.get(line)

    def predicted(self, predictions: dict[int, Prediction | None]) -> None:
        """New profiles by input line. "ahead": `refresh` with their vectors, the compact profiles kept to forward.
        "as_profiles_arrive": waiting lines join the pool, lines out join the resident set."""
        if self.fill == AHEAD:
            self.compacts.update({line: None if p is None else p.compact for line, p in predictions.items()})
            self.refresh({line: None if p is None else p.vector for line, p in predictions.items()})
            return
        for line, p in predictions.items():
            if line in self._done or line in self.router.pool or line in self._chosen:
                continue
            self.compacts[line] = p.compact
            if line in self.router.placed:
                self.router.assign(line, p.vector)
            else:
                self.router.add(line, p.vector, 0.0)

    def refresh(self, vectors: dict[int, np.ndarray | None]) -> None:
        """("ahead") New predictions by input line (a newer profile head's, batch/follow.py); the waiting ones among
        them are re-scored in place, the others when they join the pool. The lines chosen already stay chosen."""
        self.vectors.update(vectors)
        for line in vectors:
            if line in self.router.pool:
                self.router.update(line, vectors[line])

    def pick(self, waiting: Sequence[BatchRequest]) -> int:
        if not self._chosen:
            if self.fill == AHEAD:
                for r in waiting[self.router.waiting(): self.window]:  # top the pool up from the file (in file order)
                    if r.line not in self.router.pool:
                        self.router.add(r.line, self.vectors.get(r.line), 0.0)
            if self.router.waiting():
                self._chosen.extend(line for line, _ in self.router.admit(0.0))
        if not self._chosen:  # nothing pooled waits ("as_profiles_arrive"): the far end of the file
            return len(waiting) - 1
        return next(i for i, r in enumerate(waiting) if r.line == self._chosen[0])

    def sent(self, request: BatchRequest) -> None:
        if self._chosen and self._chosen[0] == request.line:
            self._chosen.popleft()
        elif self.fill == AHEAD:
            raise ValueError(f"line {request.line} was sent, but the order chose "
                             f"{f'line {self._chosen[0]}' if self._chosen else 'none'}")
        else:  # sent without a choice (the far end): it holds its slot
            self.router.hold(request.line, 0)

    def finished(self, request: BatchRequest) -> None:
        if self.fill == AS_PROFILES_ARRIVE:
            self._done.add(request.line)
        self.router.release(request.line)

    def out(self, line: int) -> bool:
        """Whether the line was chosen or sent already (a probe of it would come too late)."""
        return line in self.router.placed or line in self._done


def make_order(requests: Sequence[BatchRequest], predictor: Predictor | None, max_in_flight: int, *,
               window: int = DEFAULT_WINDOW) -> Order:
    """Admission by `predictor`'s vectors of `requests` (predicted once, here) with `max_in_flight` requests out,
    or file order without a predictor."""
    if predictor is None:
        return FileOrder()
    order = ExpertOrder(max_in_flight, predictor.resident_factory, window=window)
    order.predicted(dict(zip((r.line for r in requests), predictor.predict([r.text for r in requests]))))
    return order


def sending_order(requests: Sequence[BatchRequest], order: Order, max_in_flight: int,
                  limit: int | None = None) -> list[BatchRequest]:
    """The order `order` would send `requests` in, `max_in_flight` at a time, if they finished first in, first out
    (`--dry-run`, `--runner ray`, the Ray Data LLM rows); the first `limit` of it (None: all)."""
    waiting, out, sent = list(requests), deque(), []
    while waiting and (limit is None or len(sent) < limit):
        if len(out) >= max_in_flight:
            order.finished(out.popleft())
        request = waiting.pop(order.pick(waiting))
        order.sent(request)
        out.append(request)
        sent.append(request)
    return sent


def admission_plan(requests: Sequence[BatchRequest], predictor: Predictor | None, max_in_flight: int,
                   limit: int | None = None) -> tuple[list[BatchRequest], Order]:
    """(`sending_order` of `make_order`'s order of `requests`, that order: its `compact` profiles): the order
    admission by `predictor` would send them in, or file order without one."""
    order = make_order(requests, predictor, max_in_flight)
    return sending_order(requests, order, max_in_flight, limit), order
