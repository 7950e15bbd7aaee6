"""Prometheus metrics of the proxy, in a registry of its own (one per app, so tests can build many)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LAG_EVERY_S = 0.1  # how often the event loop's lag is sampled
OWN_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cohort_requests", "Requests, by route and the status each ended with (499: the client left)",
                                ["route", "status"], registry=r)
        self.queue_seconds = Histogram("cohort_queue_seconds", "Time from arrival to dispatch", buckets=LATENCY_BUCKETS, registry=r)
        self.backend_seconds = Histogram("cohort_backend_seconds", "Backend time to response headers", ["route"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.profile_seconds = Histogram("cohort_profile_seconds", "Embedding + profile prediction time per group of arrivals",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.own_seconds = Histogram("cohort_proxy_seconds", "The proxy's own time per request: arrival to response "
                                     "headers, less the wait for a slot and the backend's time", ["route"],
                                     buckets=OWN_BUCKETS, registry=r)
        self.profile_late = Counter("cohort_profile_late", "Requests that went on without a profile: its prediction "
                                    "missed the deadline (profile_deadline_ms)", registry=r)
        self.in_flight = Gauge("cohort_in_flight", "Requests at the backend now", registry=r)
        self.waiting = Gauge("cohort_waiting", "Requests being profiled or waiting for a backend slot", registry=r)
        # online learning of the profile head (send/learning/learning.py, --learn)
        self.learned_profiles = Counter("cohort_learned_profiles", "Observed expert profiles of answered requests "
                                        "the profile head learned from, by source", ["source"], registry=r)
        self.learned_dropped = Counter("cohort_learned_dropped", "Observations not learned from: invalid, or over "
                                       "the backlog", ["reason"], registry=r)
        self.learned_refits = Counter("cohort_learned_refits", "Refits of the learned profile head", registry=r)
        self.learning_cpu = Counter("cohort_learning_cpu_seconds", "CPU seconds online learning took, by thread: the "
                                    "learning worker (features, observations, refits, a batch's re-predictions) and "
                                    "the event loop (reading the engine's counts)", ["thread"], registry=r)
        self.learned_head_age = Gauge("cohort_learned_head_age_seconds", "Seconds since the learned head was "
                                      "fitted (NaN: none yet)", registry=r)
        self.learned_head_observations = Gauge("cohort_learned_head_observations", "Observations the learned head "
                                               "was fitted on", registry=r)
        self.learned_head_fit = Gauge("cohort_learned_head_fit", "Mean share of a request's observed profile that "
                                      "its prediction covers, over the latest observed requests (none seen by a head "
                                      "when predicted): the head's, and the mean profile's (what learning nothing "
                                      "scores)", ["predictor"], registry=r)
        self.loop_lag = Histogram("cohort_event_loop_lag_seconds", f"How late the event loop ran a timer, sampled "
                                  f"every {LAG_EVERY_S:g} s: a time in which it served no request", buckets=LAG_BUCKETS,
                                  registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(lag: Histogram, every_s: float = LAG_EVERY_S) -> None:
    """Until cancelled: every `every_s`, how much later than asked the event loop woke this task, into `lag`."""
    while True:
        asked = time.perf_counter() + every_s
        await asyncio.sleep(every_s)
        lag.observe(max(0.0, time.perf_counter() - asked))
