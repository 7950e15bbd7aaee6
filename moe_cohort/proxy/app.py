"""The OpenAI-compatible proxy: FastAPI routes in front of a vLLM backend.

    POST /v1/chat/completions, /v1/completions,        admitted by predicted experts, sent with a policy
         /v1/responses
    GET  /v1/models, /v1/embeddings, ...               relayed from the backend (proxy/relay.py)
    GET  /health, GET /metrics                         proxy + backend health, Prometheus text
    /v1/files, /v1/batches                             the OpenAI Batch API (proxy/batch/api.py)

`create_app(settings)` builds everything once: the settings, the backend client, the encoder
and profile head (the predictor), the admission gate and the metrics. Before it serves, its lifespan
asks each replica what it is and serves it accordingly (send/handshake.py, send/autoconfig.py).
Every request gets a request id and an access log line (proxy/http/middleware.py); every error
leaves in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from moe_cohort.proxy.batch.api import add_batch_api
from moe_cohort.proxy.batch.jobs import BatchJobs
from moe_cohort.proxy.health import health_answer
from moe_cohort.proxy.http.answers import add_error_handlers, error_answer
from moe_cohort.proxy.http.api_docs import OFF as API_DOCS_OFF, add_api_docs
from moe_cohort.proxy.http.fastpath import FastPath
from moe_cohort.proxy.http.limits import HeadLimits
from moe_cohort.proxy.http.middleware import RequestContext, access_log, route_label
from moe_cohort.proxy.relay import add_relay_routes
from moe_cohort.proxy.streaming import StreamRelay
from moe_cohort.proxy.whole import reply
from moe_cohort.send.auth import Authorizer, backend_headers
from moe_cohort.send.autoconfig import (LearningPlan, describe, fed_at, passed_bound, plan_batch, plan_learning,
                                        plan_replica)
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.gate import AdmissionGate, Profiler
from moe_cohort.send.handshake import UNREACHABLE, EngineInfo, ask
from moe_cohort.send.hints import HintRules
from moe_cohort.send.learning.learning import Learning, follow_learned, learned_folder, load_learner
from moe_cohort.send.lifecycle import Lifecycle
from moe_cohort.send.metrics import Metrics, watch_loop_lag
from moe_cohort.send.profiles import Predictor, make_predictor
from moe_cohort.send.protocol import Route, check_size, read_body, read_request
from moe_cohort.send.replicas import ReplicaSet
from moe_cohort.send.setting_sources import load_settings
from moe_cohort.send.settings import Settings
from moe_cohort.train.online import OnlineLearner

log = logging.getLogger(__name__)

PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
                           "responses": "/v1/responses"}
HEALTH_EVERY_S = 2.0  # how often the replicas are checked (GET /health each)


class Proxy:
    """The request path, independent of routing: auth, parse, admit, forward, relay."""

    def __init__(self, settings: Settings, predictor: Predictor | None, learner: OnlineLearner | None = None) -> None:
        self.settings, self.predictor = settings, predictor
        self.metrics = Metrics()
        clients = [BackendClient.of(settings, url) for url in settings.backends]
        self.learning = None if learner is None or predictor is None else Learning(
            learner, predictor.features, learned_folder(settings), self.metrics, settings.learn_sample_rate, clients,
            on=None)
        # one backend is a set of one replica; several (--backend repeated) are routed by --replica-routing. Until the
        # replicas have answered the handshake (`configure`), each is served as one that said nothing.
        self.engines = [EngineInfo(UNREACHABLE)] * len(clients)
        self.plans = [plan_replica(settings, info) for info in self.engines]
        self.replicas = ReplicaSet(clients, [p.max_in_flight for p in self.plans], settings.replica_routing,
                                   max_queue_s=settings.max_queue_ms / 1000,
                                   max_passed=settings.max_passed or passed_bound(self.plans),
                                   **({"resident_factory": predictor.resident_factory} if predictor else {}))
        profiler = Profiler(predictor.predict, self.metrics.profile_seconds, predictor.ready) if predictor else None
        self.gate = AdmissionGate(profiler, self.metrics, replicas=self.replicas,
                                  profile_first=any(p.engine_side for p in self.plans),
                                  deadline_s=settings.profile_deadline_ms / 1000 if settings.profile_deadline_ms
                                  else predictor.deadline_s if predictor else 0.0)
        self.learning_plan: LearningPlan | None = None
        self._decide_learning()  # now when a setting says, else when a replica answers
        self.configuration = ""  # what `configure` chose, one line
        self.batch_jobs: BatchJobs | None = None  # the Batch API's, configured with the replicas (`configure`)
        self.authorize = Authorizer(settings.api_keys)  # called with a request's headers

    async def close(self) -> None:
        self.gate.close()
        if self.learning is not None:
            await self.learning.flush(timeout_s=2.0)  # the counts of requests answered just before
            await asyncio.to_thread(self.learning.close)
        await self.replicas.close()

    async def configure(self, replicas: Sequence[int] | None = None) -> str:
        """Ask `replicas` (default: all) what they are and serve each accordingly (send/autoconfig.py): slots,
        where admission runs, whether to learn (decided once, when the first replica answers). The line saying
        what was chosen and why."""
        replicas = range(len(self.replicas.clients)) if replicas is None else replicas
        infos = await asyncio.gather(*(ask(self.replicas.clients[r]) for r in replicas))
        for r, info in zip(replicas, infos):
            self.engines[r], self.plans[r] = info, plan_replica(self.settings, info)
            self.replicas.set_capacity(r, self.plans[r].max_in_flight)
        self.gate.profile_first = any(p.engine_side for p in self.plans)
        self.gate.fed_at = fed_at(self.engines)
        self.replicas.router.max_passed = self.settings.max_passed or passed_bound(self.plans)
        self._decide_learning()
        if self.batch_jobs is not None:
            self.batch_jobs.configure(plan_batch(self.settings, self.settings.backends, self.engines))
        return describe(self.settings.backends, self.plans, self.learning_plan)

    def _decide_learning(self) -> None:
        """Whether to learn is decided once (send/autoconfig.py: a setting, else the first replica's answer)."""
        if self.learning_plan is None or self.learning_plan.on is None:
            self.learning_plan = plan_learning(self.settings, self.engines)
            if self.learning is not None and self.learning_plan.on is not None:
                self.learning.decide(self.learning_plan.on)

    async def watch_replicas(self, every_s: float | None = None) -> None:
        """Every `every_s`: check the replicas (send/replicas.py: one that stops answering goes out, never the
        last; one that answers again comes back); a replica that came back, or never answered the handshake, is
        asked it again and served by its answer."""
        while True:
            await asyncio.sleep(every_s or HEALTH_EVERY_S)
            try:
                await self._recheck()
            except Exception:  # a bug here must not stop the checks
                log.exception("checking the backend replicas failed")

    async def _recheck(self) -> None:
        was = self.replicas.router.healthy.copy()  # [R]
        up = await self.replicas.check()
        again = [r for r, info in enumerate(self.engines) if up[r] and (info.source == UNREACHABLE or not was[r])]
        if again:
            before = list(self.plans), self.learning_plan
            line = await self.configure(again)
            if (list(self.plans), self.learning_plan) != before:
                log.warning("%s", line)

    async def body(self, request: Request) -> bytes:
        """The authorized request's body, refused (413) as soon as it passes the size limit."""
        self.authorize(request.headers)
        check_size(request.headers.get("content-length"), self.settings.max_body_bytes)
        return await read_body(request.stream(), self.settings.max_body_bytes)

    async def completion(self, request: Request, route: Route) -> Response:
        """A generating route (chat, completion, responses): read and check the request, then its Lifecycle
        admits it, sends it and answers, whole or streamed."""
        self.authorize(request.headers)
        preq = await read_request(request.stream(), request.headers, route, default_policy=self.settings.default_policy,
                                  max_bytes=self.settings.max_body_bytes, rules=HintRules.of(self.settings))
        if self.settings.log_prompts:
            log.info("%s request, policy %s: %r", route, preq.policy, preq.text)
        headers = backend_headers(self.settings, request.headers)
        life = Lifecycle(self.gate, PATHS[route], preq.body, preq.text, headers, learning=self.learning, route=route,
                         metrics=self.metrics,
                         started=request.scope.get("state", {}).get("started"))  # proxy.http.middleware
        if preq.stream:
            return await StreamRelay(life, self.settings.keepalive_s,
                                     request.scope.setdefault("state", {})).start(request.receive)
        return await reply(life, request.receive)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app."""
    settings = settings or load_settings()
    if not settings.backends:
        raise ValueError("settings.backends is empty; pass --backend URL (or run `cohort serve` without it "
                         "to start the embedded vLLM backend)")
    learner = load_learner(settings) if settings.learn is not False and settings.encoder.lower() != "none" else None
    predictor = make_predictor(settings, threads=settings.encoder_threads)
    proxy = Proxy(settings, predictor, learner)
    follow_learned(predictor, proxy.learning, settings)  # admission reads the learned head, and whether learning is on

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.configuration = await proxy.configure()  # before any request: the engines say how to serve them
        log.info("%s", proxy.configuration)
        await batch_jobs.resume()  # batches that were running when the proxy stopped
        if proxy.learning is not None and proxy.learning.on:
            await proxy.learning.ask_served()  # whether the backend's plugin serves expert counts
        # Everything loaded so far (encoder, FAISS, the app) lives as long as the process: keep it out
        # of the garbage collector's full passes, which otherwise stall every request in flight now
        # and then, longer the more objects are loaded (docs/results.md).
        # vLLM's API server does the same after startup.
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        watchers = [loop.create_task(proxy.watch_replicas()), loop.create_task(watch_loop_lag(proxy.metrics.loop_lag))]
        yield
        for watcher in watchers:
            watcher.cancel()
        await batch_jobs.close()
        await proxy.close()

    app = FastAPI(title="moe-cohort proxy", lifespan=lifespan, **API_DOCS_OFF)  # FastAPI's docs: open to anyone
    if settings.api_docs:  # ours: behind the key
        add_api_docs(app, proxy.authorize)
    app.state.proxy = proxy
    access_log.setLevel(logging.INFO if settings.access_log else logging.WARNING)
    add_error_handlers(app)
    batch_jobs = proxy.batch_jobs = BatchJobs(settings, proxy.replicas.clients, proxy.predictor, gate=proxy.gate,
                                              learning=proxy.learning)
    add_batch_api(app, batch_jobs, proxy.authorize, settings.max_file_bytes)

    async def chat_completions(request: Request) -> Response:
        return await proxy.completion(request, "chat")

    async def completions(request: Request) -> Response:
        return await proxy.completion(request, "completion")

    async def responses(request: Request) -> Response:  # admitted like a completion, its text from `input`
        return await proxy.completion(request, "responses")

    # the generating routes skip FastAPI's layers (proxy/http/fastpath.py); routes here too, for the OpenAPI schema
    admitted = {"chat": chat_completions, "completion": completions, "responses": responses}
    for route, handler in admitted.items():
        app.post(PATHS[route])(handler)
    app.add_middleware(FastPath, routes={PATHS[route]: (handler, route) for route, handler in admitted.items()},
                       on_error=error_answer)

    add_relay_routes(app, proxy)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await health_answer(proxy, request)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if settings.protect_metrics:
            proxy.authorize(request.headers)
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    names = {path: route for route, path in PATHS.items()}

    def ended(scope, status: int) -> None:  # every request, once, where it ends
        proxy.metrics.requests.labels(route_label(scope, names), str(status)).inc()

    # added last, so outermost: around the fast path too
    app.add_middleware(RequestContext, limits=HeadLimits(settings.max_header_bytes, settings.max_headers), on_end=ended)
    return app
