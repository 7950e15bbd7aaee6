"""Online learning in the proxy: the served model's routing of answered requests teaches admission's profile head.

Learning (on where a replica serves its expert counts, proxy/autoconfig.py; `--learn` / `--no-learn`
decide otherwise) pairs each observed request's head features (its prompt's embedding and
hashed n-grams, kept from its prediction on arrival or computed in the worker thread; never the text)
with the expert counts the engine reports for it (traces.observed), keeps them in a train.online.OnlineLearner,
refits the head off the event loop when enough new ones arrived, swaps it in (admission reads
`Learning.head` per prediction) and saves reservoir and head under `--data-dir`/learned after a refit
at most once a minute and when it stops, so a restart keeps what was learned. Until its first head, admission runs on the trained
folder's head if the encoder has one, else first come, first served.

Where the counts come from (one `Observed` either way):
- our plugin (`mark` / `finished`): a sampled request goes out with `vllm_xargs.moe_observe` = a token;
  the plugin counts its experts in the engine and, once it finished, the proxy takes the counts from
  the replica that served it (`POST /v1/cohort/observed`, engine.observed_endpoint; polled every
  POLL_S while requests are waiting, given up after GIVE_UP_S). The vLLM server the proxy already
  talks to serves them, so it works the same embedded and across containers; streamed or not. The
  proxy marks requests once the (first) backend said it serves that route; one that says it does
  not (404) leaves the second source, with a warning saying how to turn the first on;
- vLLM's `routed_experts` field (`relay_answer`): a non-streamed answer of a server started with
  `--enable-return-routed-experts` (vLLM 0.32, Model Runner V2) carries, per choice, base64 `.npy`
  [tokens - 1, L, k]; the proxy reads it with the answer's `usage.prompt_tokens` and strips it from
  what the client receives unless the client asked for it (sent vLLM's `routed_experts_prompt_start`).

Which requests are observed: the reservoir decides on arrival whether it will keep a request (every
one until it is full, then capacity / seen of them: train.online.Reservoir), and only those, plus
`--learn-sample-rate` of the others, are counted; the others feed the live fit only. So the engine
counts, and the proxy learns from, a share of the traffic that falls as it goes on.

Over 300 lines because the marking, the polling of the counts, the worker that learns and the
worker's place behind serving share one object's state (tokens waiting per replica, the queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import random
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np
from threadpoolctl import ThreadpoolController

from moe_cohort.admission.wire import OBSERVE_KEY
from moe_cohort.encoder.profile import ProfileHead
from moe_cohort.proxy.backend_client import BackendClient
from moe_cohort.proxy.http.errors import BackendStatusError, ProxyError
from moe_cohort.proxy.metrics import ProxyMetrics
from moe_cohort.traces.observed import BadObservation, Observed, decode_npy, from_routed_experts
from moe_cohort.train.online import LearnConfig, OnlineLearner

log = logging.getLogger(__name__)
T = TypeVar("T")

ROUTED_EXPERTS, PROMPT_START = "routed_experts", "routed_experts_prompt_start"
PLUGIN, OBSERVED_PATH = "plugin", "/v1/cohort/observed"
LIVE_ONLY = "-live"  # the end of the moe_observe token of a request observed for the live fit only
POLL_S, GIVE_UP_S, MAX_TAKE = 0.5, 60.0, 4096  # MAX_TAKE: engine.observed_endpoint.MAX_TOKENS
PROBE_EVERY_S = 10.0  # how often a backend that did not answer whether it serves the counts is asked again
MAX_BACKLOG = 1000  # observations waiting for the worker; more are dropped (counted), never the event loop blocked
# texts -> ([N, F] what the head reads, each text's profile as predicted on arrival [L*E], None where not at hand)
Featurize = Callable[[Sequence[str]], tuple[np.ndarray, list[np.ndarray | None]]]


class Learning:
    """The proxy's learner: `add` observations from the event loop; the worker thread learns from them."""

    def __init__(self, learner: OnlineLearner, featurize: Featurize, folder: Path, metrics: ProxyMetrics,
                 sample_rate: float = 0.05, backend: BackendClient | None = None, on: bool | None = True) -> None:
        self.learner, self.featurize, self.folder, self.metrics = learner, featurize, folder, metrics
        self.sample_rate = sample_rate
        self.on = on  # None: not decided (the engines' handshake: `decide`); learns nothing until on
        self._pending: list[tuple[str, Observed, str, bool]] = []  # text, counts, source, kept
        self._busy = False
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, "cohort-learn", initializer=_behind_serving)
        self._random = random.Random(0)
        self.backend = backend  # asked whether it serves OBSERVED_PATH
        self.plugin: bool | None = None  # whether it does (None: not known yet)
        self._probe_after, self._probes = 0.0, set()
        prefix = secrets.token_hex(4)  # this proxy's: several proxies may share a backend
        self._tokens = (f"{prefix}-{n}" for n in itertools.count())  # moe_observe tokens
        self._waiting: dict[BackendClient, dict[str, tuple[str, float, bool]]] = {}  # client -> token -> (text, when, kept)
        self._poller: asyncio.Task | None = None
        metrics.learned_head_age.set_function(lambda: time.time() - learner.fitted_at if learner.head else float("nan"))
        metrics.learned_head_observations.set_function(lambda: learner.fitted_on if learner.head else 0)
        for i, label in enumerate(("head", "mean")):
            metrics.learned_head_fit.labels(label).set_function(lambda i=i: _fit(learner, i))

    def decide(self, on: bool) -> None:
        """Learn from now on, or never (proxy/autoconfig.py decides from the engines' handshake)."""
        self.on = on

    @property
    def head(self) -> ProfileHead | None:
        """The latest learned head (None before the first fit, or while learning is not on); one attribute read,
        safe from any thread."""
        return self.learner.head if self.on else None

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

    # ---- our plugin's counts ----------------------------------------------------------------------

    def mark(self, body: dict) -> None:
        """Ask the engine to count this request's experts (a request body about to be forwarded), when sampled
        and the backend serves the counts (asked once, in the background, before the first request is marked)."""
        if not self.on:
            return
        if self.plugin is None:
            self._probe_soon()
        elif self.plugin and (kept := self.sample()) is not None:  # the token says which (a request may never end)
            token = next(self._tokens) + ("" if kept else LIVE_ONLY)
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), OBSERVE_KEY: token}

    async def probe(self) -> None:
        """Ask the backend now whether it serves the plugin's counts (at start-up: the first requests get marked)."""
        if self.backend is not None and self.plugin is None:
            self._probe_after = time.monotonic() + PROBE_EVERY_S
            await self._probe(self.backend)

    def _probe_soon(self) -> None:
        if self.backend is None or time.monotonic() < self._probe_after:
            return
        self._probe_after = time.monotonic() + PROBE_EVERY_S
        task = asyncio.get_running_loop().create_task(self._probe(self.backend))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, client: BackendClient) -> None:
        """Whether `client` serves OBSERVED_PATH: 200 with its shape (yes), 404/405 (no), else not known yet."""
        try:
            answer = await client.request("POST", OBSERVED_PATH, json={"tokens": []})
            self.plugin = isinstance(json.loads(answer.content).get("observed"), dict)
        except BackendStatusError as exc:
            if exc.status_code in (404, 405):
                self.plugin = False
        except (ProxyError, ValueError, AttributeError):
            return
        if self.plugin is False:
            log.warning("learning: %s has no %s, so the proxy learns from vLLM's routed_experts answers only; for our "
                        "plugin's counts run vLLM with it and VLLM_PLUGINS=moe_cohort (cohort serve's embedded vLLM "
                        "does)", client.base_url, OBSERVED_PATH)

    def finished(self, client: BackendClient, body: dict, text: str) -> None:
        """A marked request left `client` (answered, failed or abandoned): take its counts from there soon."""
        token = (body.get("vllm_xargs") or {}).get(OBSERVE_KEY)
        if token is None or self.plugin is False:
            return
        self._waiting.setdefault(client, {})[token] = (text, time.monotonic(), not token.endswith(LIVE_ONLY))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self._waiting:
            await asyncio.sleep(POLL_S)
            await self._take_all()

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Take the counts of the finished requests still waiting for them now, until none waits or `timeout_s`
        passed (the end of a batch run, a shutdown): the poller would have, POLL_S later."""
        deadline = time.monotonic() + timeout_s
        while self._waiting and time.monotonic() < deadline:
            await self._take_all()
            if self._waiting:
                await asyncio.sleep(0.05)

    async def _take_all(self) -> None:
        for client in list(self._waiting):
            try:
                await self._take(client, self._waiting[client])
            except Exception:  # a bug or a broken answer must not stop the polling
                log.exception("taking observed expert counts from %s failed", client.base_url)
            if not self._waiting.get(client):
                self._waiting.pop(client, None)

    async def _take(self, client: BackendClient, waiting: dict[str, tuple[str, float, bool]]) -> None:
        try:
            answer = await client.request("POST", OBSERVED_PATH, json={"tokens": list(waiting)[:MAX_TAKE]})
        except ProxyError:  # unreachable now (or a replica without the plugin): the tokens wait, and expire
            answer = None
        started = time.thread_time()
        for token, obj in (json.loads(answer.content).get("observed", {}) if answer else {}).items():
            text, _, kept = waiting.pop(token, (None, 0.0, False))
            if text is None:
                continue
            try:
                self.add(text, Observed.from_wire(obj), PLUGIN, kept)
            except BadObservation as exc:
                self.metrics.learned_dropped.labels("invalid").inc()
                log.warning("cannot learn from the plugin's counts of a request: %s", exc)
        expired = [t for t, (_, when, _) in waiting.items() if time.monotonic() - when > GIVE_UP_S]
        for token in expired:
            del waiting[token]
        if expired:
            self.metrics.learned_dropped.labels("unclaimed").inc(len(expired))
        self.metrics.learning_cpu.labels("event_loop").inc(time.thread_time() - started)

    # ---- vLLM's routed_experts -------------------------------------------------------------------

    def observe_routed(self, text: str, body: dict, answer: dict, kept: bool) -> None:
        """Learn from vLLM's routed experts of the answer's one choice (the request sent `body`; `kept`: `sample`'s)."""
        try:
            rows = decode_npy(answer["choices"][0][ROUTED_EXPERTS])
            prompt_tokens = int((answer.get("usage") or {})["prompt_tokens"])
            width = self.learner.shape[1] if self.learner.shape else int(rows.max(initial=0)) + 1
            observed = from_routed_experts(rows, prompt_tokens, width, int(body.get(PROMPT_START) or 0))
        except (BadObservation, KeyError, TypeError, ValueError) as exc:
            self.metrics.learned_dropped.labels("invalid").inc()
            log.warning("cannot learn from an answer's routed experts: %s", exc)
            return
        self.add(text, observed, ROUTED_EXPERTS, kept)

    def _drain(self) -> None:
        """Worker thread: learn from what is queued, refit when due, save after each refit."""
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._busy = False
                    return
            started = time.thread_time()
            try:
                with one_blas_thread():
                    self._learn(batch)
            except Exception:  # a bug here must not stop learning from later answers
                log.exception("learning from %d observed requests failed", len(batch))
            self.metrics.learning_cpu.labels("worker").inc(time.thread_time() - started)

    def _learn(self, batch: list[tuple[str, Observed, str, bool]]) -> None:
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
                self.learner.refit()
                self.metrics.learned_refits.inc()
                self.learner.save_when_due(self.folder, time.monotonic())  # and at close

    async def in_background(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the learning worker, behind serving (a batch's re-predictions: proxy/batch/follow.py)."""
        def call() -> T:
            started = time.thread_time()
            try:
                with one_blas_thread():
                    return fn(*args)
            finally:
                self.metrics.learning_cpu.labels("worker").inc(time.thread_time() - started)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Finish what is queued, stop the worker, save what was learned since the last refit."""
        if self._poller is not None:
            self._poller.cancel()
        self._executor.shutdown(wait=True)
        if self.learner.observed:
            self.learner.save(self.folder)


def _behind_serving() -> None:
    """The learning worker's thread runs at the lowest CPU priority (Linux's nice is per thread): on a machine it
    shares with vLLM, a refit must not take the CPU that vLLM's API server needs to start the next request
    (bench_batch_learning: without this a learning batch kept the engine at 8-11 decode tokens per forward
    where the same head without learning kept 14.4)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def one_blas_thread() -> contextlib.AbstractContextManager:
    """BLAS on one thread while the learner fits or predicts: its other threads would busy-wait on the cores vLLM
    needs (OpenBLAS); admission's scoring runs on one too. Every BLAS loaded by then: the libraries are inspected
    again when a module was imported since (an inspection costs ~2.5 ms, more than learning from a request)."""
    return _blas(len(sys.modules)).limit(limits=1, user_api="blas")


@functools.lru_cache(maxsize=1)
def _blas(modules: int) -> ThreadpoolController:
    return ThreadpoolController()  # inspects the loaded libraries (`modules`: how many Python modules were loaded)


def load_learner(settings) -> OnlineLearner:
    """The learner of the proxy's settings (`learn_*`), with what an earlier run saved in its data folder."""
    config = LearnConfig(capacity=settings.learn_capacity, refit_every=settings.learn_refit_every)
    return OnlineLearner.load(learned_folder(settings), config, key=settings.encoder)


def learned_folder(settings) -> Path:
    return settings.data_path / "learned"


def relay_answer(content: bytes, text: str, body: dict, learning: Learning | None) -> bytes:
    """A non-streamed answer's content as the client gets it: vLLM's routed experts learned from (with
    `learning`, when sampled) and stripped unless the client asked for them (`body`: the request it sent)."""
    if b'"routed_experts"' not in content:
        return content
    try:
        answer = json.loads(content)
        choices = answer.get("choices") or []
    except (ValueError, AttributeError):
        return content
    marked = OBSERVE_KEY in (body.get("vllm_xargs") or {})  # the plugin's counts of it come (once)
    if (learning is not None and not marked and len(choices) == 1 and isinstance(choices[0], dict)
            and choices[0].get(ROUTED_EXPERTS) and (kept := learning.sample()) is not None):
        learning.observe_routed(text, body, answer, kept)
    if body.get(PROMPT_START) is not None:
        return content
    for choice in choices:
        if isinstance(choice, dict):
            choice.pop(ROUTED_EXPERTS, None)
    return json.dumps(answer, separators=(",", ":")).encode()


def _fit(learner: OnlineLearner, i: int) -> float:
    fit = learner.live_fit()
    return float("nan") if fit is None else fit[i]
