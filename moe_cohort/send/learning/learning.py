"""Online learning in the proxy: the served model's routing of answered requests teaches admission's profile head.

Learning (on where a replica serves its expert counts, send/autoconfig.py; `--learn` / `--no-learn` decide
otherwise) pairs each observed request's head features (kept from its prediction on arrival, or computed on
the worker; never the text) with the expert counts the engine reports for it (send/learning/observed_counts.py),
keeps them in a train.online.OnlineLearner on a worker thread, refits the head when enough new ones arrived (in a
process of its own at the lowest CPU priority: send/learning/behind_serving.py), swaps it in (admission reads
`Learning.head` per prediction) and saves reservoir and head under `--data-dir`/learned after a refit at most once
a minute and when it stops, so a restart keeps what was learned.

Which requests are observed: those the reservoir will keep (every one until it is full, then capacity / seen
of them: train.online.Reservoir), plus `learn_sample_rate` of the others, which feed the live fit only. So
the engine counts, and the proxy learns from, a share of the traffic that falls as it goes on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np

from moe_cohort.encoder.profile import ProfileHead
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.learning.behind_serving import fit_apart, one_blas_thread, start_apart, stop_apart
from moe_cohort.send.learning.observed_counts import (ROUTED_EXPERTS, ObservedCounts, client_answer, marked,
                                                      one_routed_choice, routed_counts)
from moe_cohort.send.metrics import Metrics
from moe_cohort.traces.observed import BadObservation, Observed
from moe_cohort.train.online import LearnConfig, OnlineLearner

log = logging.getLogger(__name__)
T = TypeVar("T")

PLUGIN = "plugin"  # the source label of our plugin's counts (ROUTED_EXPERTS: vLLM's)
CLOSE_WAIT_S = 30.0  # how long closing waits for the worker's queue before it stops a refit
MAX_BACKLOG = 1000  # observations waiting for the worker; more are dropped (counted), never the event loop blocked
# texts -> ([N, F] what the head reads, each text's profile as predicted on arrival [L*E], None where not at hand)
Featurize = Callable[[Sequence[str]], tuple[np.ndarray, list[np.ndarray | None]]]
Pending = tuple[str, Observed, str, bool]  # text, counts, source, kept


class Learning:
    """The proxy's learner: observations come in on the event loop; the worker thread learns from them."""

    def __init__(self, learner: OnlineLearner, featurize: Featurize, folder: Path, metrics: Metrics,
                 sample_rate: float = 0.05, replicas: Sequence[BackendClient] = (), on: bool | None = True) -> None:
        self.learner, self.featurize, self.folder, self.metrics = learner, featurize, folder, metrics
        self.sample_rate = sample_rate
        self.on = on  # None: not decided (the engines' handshake: `decide`); learns nothing until on
        self.counts = ObservedCounts(replicas, lambda text, observed, kept: self.add(text, observed, PLUGIN, kept),
                                     lambda why, n: metrics.learned_dropped.labels(why).inc(n),
                                     metrics.learning_cpu.labels("event_loop").inc)
        self._pending: list[Pending] = []
        self._busy = False
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, "cohort-learn")  # its refits in a process of their own (fit_apart)
        self._random = random.Random(0)
        _show(learner, metrics)
        if on is not False:
            start_apart()

    def decide(self, on: bool) -> None:
        """Learn from now on, or never (send/autoconfig.py decides from the engines' handshake)."""
        self.on = on
        if on:
            start_apart()

    @property
    def head(self) -> ProfileHead | None:
        """The latest learned head, this run's or the one an earlier run saved (None before the first fit), whether
        or not learning goes on; one attribute read, safe from any thread."""
        return self.learner.head

    def describe(self) -> dict:
        """What /health shows of the learning."""
        learner = self.learner
        out = {"observed": learner.observed, "head_fitted_on": learner.fitted_on if learner.head else 0}
        if learner.head is None:
            out["first_head_after"] = learner.config.first_fit
        return out

    def sample(self) -> bool | None:
        """Whether to observe the next request: True when the reservoir keeps it, False for one of the others
        observed anyway (`sample_rate` of them: the live fit), None when not observed (always, unless on)."""
        if not self.on:
            return None
        if self.learner.reservoir.offer():
            return True
        return False if self._random.random() < self.sample_rate else None

    # The request's events, each entered once by the lifecycle (send/lifecycle.py): sending, answered, left.

    def sending(self, body: dict) -> None:
        """A request `body` is about to be forwarded: when sampled and the backend serves the plugin's counts
        (asked once, in the background, before the first request is marked), it is marked for the engine to count
        its experts."""
        if not self.on:
            return
        if self.counts.serves is None:
            self.counts.ask_served_soon()
        elif self.counts.serves and (kept := self.sample()) is not None:
            self.counts.mark(body, kept)

    async def ask_served(self) -> None:
        """Ask the backend now whether it serves the plugin's counts (at start-up: the first requests get marked)."""
        await self.counts.ask_served()

    def answered(self, content: bytes, body: dict, text: str) -> bytes:
        """A whole 200 answer came back for `body` (sent for `text`): learned from when it carries vLLM's routed
        experts and the request is sampled; returned as the client gets it (routed experts stripped unless the
        client asked for them)."""
        relayed, routed = client_answer(content, body)
        if routed is not None:
            self._routed(routed, body, text)
        return relayed

    def left(self, client: BackendClient, body: dict, text: str) -> None:
        """A request left `client` (answered, failed or abandoned): when marked, its counts are taken from there."""
        self.counts.finished(client, body, text)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Take the counts of the finished requests still waiting for them now, until none waits or `timeout_s`
        passed (the end of a batch run, a shutdown)."""
        await self.counts.flush(timeout_s)

    def dropped(self, reason: str, n: int = 1) -> None:
        """`n` observations not learned from, for `reason` (the metric's label)."""
        self.metrics.learned_dropped.labels(reason).inc(n)

    @property
    def num_experts(self) -> int | None:
        """Experts per layer of what was learned so far (None before the first observation)."""
        return self.learner.shape[1] if self.learner.shape else None

    def _routed(self, answer: dict, body: dict, text: str) -> None:
        """Learn from the routed experts in a whole answer of vLLM (`answer`, to the request `body` sent for
        `text`) when this request is sampled and the plugin's counts do not come for it (not `marked`)."""
        if marked(body) or not one_routed_choice(answer) or (kept := self.sample()) is None:
            return
        try:
            observed = routed_counts(answer, body, self.num_experts)
        except BadObservation as exc:
            log.warning("cannot learn from an answer's routed experts: %s", exc)
            self.dropped("invalid")
            return
        self.add(text, observed, ROUTED_EXPERTS, kept)

    def add(self, text: str, observed: Observed, source: str, kept: bool) -> None:
        """Queue one observation of a request whose prompt is `text` (the worker learns from it)."""
        with self._lock:
            if len(self._pending) >= MAX_BACKLOG:
                self.metrics.learned_dropped.labels("backlog").inc()
                return
            self._pending.append((text, observed, source, kept))
            if self._busy:
                return
            self._busy = True
        self._executor.submit(self._drain)

    def _drain(self) -> None:
        """Worker thread: learn from what is queued, refit when due, save after each refit."""
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._busy = False
                    return
            try:
                self._on_worker(self._learn, batch)
            except Exception:  # a bug here must not stop learning from later answers
                log.exception("learning from %d observed requests failed", len(batch))

    def _learn(self, batch: list[Pending]) -> None:
        features, predicted = self.featurize([text for text, *_ in batch])  # [n, F], n x [L*E] or None
        for f, p, (_, observed, source, kept) in zip(features, predicted, batch):
            try:
                self.learner.observe(f[None], [observed], [p], [kept])
            except ValueError as exc:
                self.metrics.learned_dropped.labels("invalid").inc()
                log.warning("not learning from an observation: %s", exc)
                continue
            self.metrics.learned_profiles.labels(source).inc()
            if self.learner.due():  # checked per observation: the schedule does not depend on how they were batched
                self.learner.refit(fit_apart)
                self.metrics.learned_refits.inc()
                self.learner.save_when_due(self.folder, time.monotonic())  # and at close

    def _on_worker(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on one BLAS thread, its CPU time counted as the worker's (called on the worker thread)."""
        started = time.thread_time()
        try:
            with one_blas_thread():
                return fn(*args)
        finally:
            self.metrics.learning_cpu.labels("worker").inc(time.thread_time() - started)

    async def fit_now(self) -> None:
        """Refit the head on every observation kept so far and save it, on the worker after what is queued (a
        batch's hand-over from its sample to its order: batch/follow.py)."""
        await self.in_background(self._fit_and_save)

    def _fit_and_save(self) -> None:
        if self.learner.reservoir.size >= 2 and self.learner.reservoir.stored != self.learner.stored_at_fit:
            self.learner.refit(fit_apart)
            self.metrics.learned_refits.inc()
        if self.learner.observed:
            self.learner.save(self.folder)

    async def in_background(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the learning worker, behind serving (a batch's re-predictions: batch/follow.py)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._on_worker, fn, *args)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Finish what is queued, stop the worker, save what was learned since the last refit. A refit still running
        after `timeout_s` is stopped (its process killed); a worker that still does not end is left, unsaved."""
        self.counts.close()
        drained = self._executor.submit(lambda: None)  # runs once everything queued before it has
        self._executor.shutdown(wait=False)
        try:
            drained.result(timeout_s)
        except TimeoutError:
            log.warning("learning's worker was still busy %.0f s after closing began; stopping its refit", timeout_s)
            stop_apart()
            try:
                drained.result(timeout_s)
            except TimeoutError:
                log.error("learning's worker did not end; what it learned since its last save is not saved")
                return
        if self.learner.observed:
            self.learner.save(self.folder)


def _show(learner: OnlineLearner, metrics: Metrics) -> None:
    """The learned head's gauges, read at each scrape: its age, what it was fitted on, its live fit."""
    metrics.learned_head_age.set_function(lambda: time.time() - learner.fitted_at if learner.head else float("nan"))
    metrics.learned_head_observations.set_function(lambda: learner.fitted_on if learner.head else 0)
    for i, label in enumerate(("head", "mean")):
        metrics.learned_head_fit.labels(label).set_function(lambda i=i: _fit(learner, i))


def _fit(learner: OnlineLearner, i: int) -> float:
    fit = learner.live_fit()
    return float("nan") if fit is None else fit[i]


def load_learner(settings, refit_every: int | None = None) -> OnlineLearner:
    """The learner of the proxy's settings (`learn_*`; `refit_every` instead of theirs when given), with what an
    earlier run saved in its data folder."""
    config = LearnConfig(capacity=settings.learn_capacity, refit_every=refit_every or settings.learn_refit_every)
    return OnlineLearner.load(learned_folder(settings), config, key=settings.encoder)


def saved_head(settings) -> ProfileHead | None:
    """The head an earlier run learned for the settings' encoder and saved in `--data-dir`/learned; None when none."""
    return load_learner(settings).head


def follow_learned(predictor, learning: "Learning | None", settings) -> None:
    """The one wiring of a predictor (send.profiles.Predictor; None: nothing to wire) to a head: the one `learning`
    learns, read per prediction, else the head an earlier run saved in the settings' data dir, if any."""
    from moe_cohort.send.profiles import FixedHead

    if predictor is None:
        return
    if learning is not None:
        predictor.follow(learning)
    elif (head := saved_head(settings)) is not None:
        predictor.follow(FixedHead(head))  # not learning: admission reads what an earlier run learned


def learned_folder(settings) -> Path:
    """Where the proxy keeps what it learned: `--data-dir`/learned."""
    return settings.data_path / "learned"
