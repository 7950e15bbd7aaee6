"""The decisions of a batch run, without I/O: what to send next, what to make of an answer, when to stop.

Shaped like nano-vllm's scheduler. `BatchCore` holds the waiting requests in file order, asks its
`Order` (batch/order.py: file order, a spread sample, or admission by predicted experts; the run may
hand `order` over to another between two sends: batch/follow.py) which one goes next,
and answers the sender (batch/run.py), which does the sending, the sleeping and the writing:

    schedule(now)          Send(request, request_id) while fewer than `max_in_flight` requests are out;
                           None when all slots are taken; Stop.DONE when every request was handed
                           out; Stop.EXPIRED once `now` is past the deadline (nothing more is sent)
    on_outcome(send, o)    Finish(record) | Retry(delay_s, reason) | Abort(message)
    committed(records)     count records the journal made durable into RunStats (usage included)

Retries: 429, 408, 5xx and timeouts are retried with exponential backoff, each wait drawn between half
and all of its step (so the retries of one batch spread out); a request keeps its slot while it waits, so an
overloaded backend is not sent more. After `max_retries` the backend's answer (or a backend_timeout
error) finishes the request in the error file; another 4xx does at once. An unreachable backend after
the retries is an Abort: the requests are fine, the backend is not, and a rerun resumes.

Nothing here awaits, sleeps or touches a socket or file: time comes in as `now`, jitter from an
injected `random.Random`.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from moe_cohort.batch.format import BatchFile, BatchRequest, failure_line, new_id, result_line
from moe_cohort.batch.journal import Journal, Record
from moe_cohort.batch.order import FileOrder, Order
from moe_cohort.send.engine_counters import DecodeCounters
from moe_cohort.send.settings import Settings

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class RunConfig:
    max_in_flight: int = 16  # requests at the backend at once (its max_num_seqs and a queue as deep)
    max_retries: int = 5
    backoff_s: float = 0.5  # first retry delay; doubles per attempt, up to max_backoff_s
    max_backoff_s: float = 30.0
    metrics_interval_s: float = 2.0  # how often the backend's decode counters are read (0: never)
    forward_profiles: bool = False  # each request carries its predicted profile (for moe-cohort's scheduler in vLLM)
    probe: bool = False  # order by the engine's routing of each prompt, probed ahead (batch/probe.py)
    api_key: str = ""  # sent to the backend as `Authorization: Bearer` (send/auth.py builds the header)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides) -> "RunConfig":
        """The run's configuration from the process's one Settings object (`overrides` win)."""
        return cls(**{"max_in_flight": settings.max_in_flight_for_batches, "forward_profiles": bool(settings.forward_profiles),
                      "probe": bool(settings.batch_probe),
                      "max_retries": settings.batch_max_retries, "api_key": settings.backend_api_key, **overrides})


@dataclass
class RunStats:
    total: int  # requests in the file (valid lines)
    finished_before: int  # requests finished by earlier runs
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)
    succeeded: int = 0  # this run
    failed: int = 0  # this run (answered with an error, or none after the retries)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode: DecodeCounters | None = None  # the plugin's decode counters over this run (send/engine_counters.py)
    probed: int | None = None  # lines whose prompt the engine routed before their turn (None: the run does not probe)

    def __post_init__(self) -> None:
        self.started = self.started or self.clock()

    @property
    def done(self) -> int:
        return self.finished_before + self.succeeded + self.failed

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.elapsed, 1e-9)


@dataclass(frozen=True)
class Answered:
    status: int  # the backend's status code (any)
    body: object  # its decoded JSON, else its text


@dataclass(frozen=True)
class TimedOut:
    message: str


@dataclass(frozen=True)
class Unreachable:
    message: str


Outcome = Answered | TimedOut | Unreachable


@dataclass(frozen=True)
class Send:
    request: BatchRequest
    request_id: str  # one per request, kept across its retries


@dataclass(frozen=True)
class Finish:
    record: Record


@dataclass(frozen=True)
class Retry:
    delay_s: float
    reason: str


@dataclass(frozen=True)
class Abort:
    message: str


class Stop(enum.Enum):
    DONE = "every request was handed out"
    EXPIRED = "the deadline passed"


class BatchCore:
    """The waiting requests (file order), the ones out at the backend, and the run's statistics."""

    def __init__(self, requests: Sequence[BatchRequest], config: RunConfig, stats: RunStats, *,
                 order: Order | None = None, deadline: float | None = None, rng: random.Random | None = None) -> None:
        self.config, self.stats, self.deadline = config, stats, deadline
        self.order, self.rng = order or FileOrder(), rng or random.Random()
        self.waiting = list(requests)
        self.out: dict[int, BatchRequest] = {}  # input line -> the request, for requests out now
        self.attempts: dict[int, int] = {}  # input line -> failed attempts so far, for requests out now

    def schedule(self, now: float) -> Send | Stop | None:
        """The next request to send, None while every slot is taken, or why nothing more goes."""
        if self.deadline is not None and now >= self.deadline:
            return Stop.EXPIRED
        if not self.waiting:
            return Stop.DONE
        if len(self.attempts) >= self.config.max_in_flight:
            return None
        request = self.waiting.pop(self.order.pick(self.waiting))
        self.order.sent(request)
        self.out[request.line], self.attempts[request.line] = request, 0
        return Send(request, new_id("req_"))

    def on_outcome(self, send: Send, outcome: Outcome) -> Finish | Retry | Abort:
        """What to do after one attempt; Finish and Abort free the request's slot."""
        request, last = send.request, self.attempts[send.request.line] == self.config.max_retries
        if isinstance(outcome, Answered) and (outcome.status < 400 or last or not retryable(outcome.status)):
            kind = "output" if outcome.status < 400 else "errors"
            line = result_line(request, send.request_id, outcome.status, outcome.body)
            return self._finish(request, Record(request.line, kind, line))
        if isinstance(outcome, TimedOut) and last:
            line = failure_line(request.custom_id, "backend_timeout", outcome.message)
            return self._finish(request, Record(request.line, "errors", line))
        if isinstance(outcome, Unreachable) and last:
            self._finish(request, None)
            return Abort(outcome.message)
        return self._retry(request.line, outcome)

    def committed(self, records: Sequence[Record]) -> None:
        """Count records that are now durable: successes, failures, and the usage of the answered ones."""
        for r in records:
            if r.kind == "errors":
                self.stats.failed += 1
                continue
            self.stats.succeeded += 1
            body = r.data["response"]["body"]
            usage = body.get("usage") if isinstance(body, dict) else None
            if isinstance(usage, dict):
                self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)

    def _finish(self, request: BatchRequest, record: Record | None) -> Finish:
        """Free the request's slot (record None: it goes unfinished, the run aborts)."""
        del self.attempts[request.line], self.out[request.line]
        self.order.finished(request)
        return Finish(record)

    def _retry(self, line: int, outcome: Outcome) -> Retry:
        attempt = self.attempts[line]
        self.attempts[line] = attempt + 1
        step = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** attempt)
        reason = (f"status {outcome.status}" if isinstance(outcome, Answered)
                  else "timeout" if isinstance(outcome, TimedOut) else "backend unreachable")
        return Retry(step * (0.5 + self.rng.random() / 2), reason)


def retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def left_to_run(batch: BatchFile, journal: Journal, skip_invalid: bool) -> tuple[list[BatchRequest], RunStats]:
    """What is left of a file: the requests no run has finished (batch/journal.py's `done`), and the run's stats
    counting those finished before; invalid lines, when skipped, go to the error file first, once."""
    if skip_invalid:
        journal.commit(invalid_records(batch, journal.done))
    pending = [r for r in batch.requests if r.line not in journal.done]
    return pending, RunStats(total=len(batch.requests), finished_before=len(batch.requests) - len(pending))


def invalid_records(batch: BatchFile, done: dict[int, str]) -> list[Record]:
    """Error-file records for the file's invalid lines that no earlier run wrote."""
    return [Record(e.line, "errors", failure_line(e.custom_id, "invalid_request", e.message))
            for e in batch.errors if e.line not in done]


def expired_records(requests: Sequence[BatchRequest], done: dict[int, str]) -> list[Record]:
    """Error-file records (batch_expired) for every request not finished when the window closed."""
    return [Record(r.line, "errors", failure_line(r.custom_id, "batch_expired", EXPIRED_MESSAGE))
            for r in requests if r.line not in done]
