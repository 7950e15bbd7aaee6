"""`GET /health` of the proxy: its status, and for callers allowed to see the backends what it serves and how.

    200 {"status": "ok" | "degraded", "routing": ..., "replicas": [{"backend": URL, "healthy": ...}, ...],
         "admission": {...}, "configuration": {...}}
    503 {"status": "backend unavailable", ...}: no replica answers

Every replica (one backend: a set of one) is checked now. With protect_metrics on (COHORT_PROTECT_METRICS) a
caller without a key gets the status alone: load balancers may probe, but the backends' addresses and the
admission's state are for key holders.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moe_cohort.send.autoconfig import health


async def health_answer(proxy, request: Request) -> Response:
    """The answer of `proxy` (proxy.app.Proxy) to `request`: each replica checked now (taken out or back in by the
    answer, send/replicas.py); 200 while one is up."""
    shown = not proxy.settings.protect_metrics or proxy.authorize.allows(request.headers)
    up = await proxy.replicas.check()
    router = proxy.replicas.router
    replicas = [{"backend": c.base_url, "healthy": ok, "in_flight": int(busy), "max_in_flight": int(cap)}
                for c, ok, busy, cap in zip(proxy.replicas.clients, up, router.busy, router.capacity)]
    status = "ok" if all(up) else "degraded" if any(up) else "backend unavailable"
    return JSONResponse({"status": status, **({"routing": router.routing, "replicas": replicas,
                                               **admission_health(proxy)} if shown else {})},
                        status_code=200 if any(up) else 503)


def admission_health(proxy) -> dict:
    """What admission runs on (a learned head, a trained folder's, embeddings only, or nothing: FCFS) and how each
    replica is served (send/autoconfig.py)."""
    if proxy.predictor is None:
        admission = {"mode": "first come, first served (--encoder none)"}
    else:
        admission = {"mode": proxy.predictor.mode()}
    if proxy.learning is not None and proxy.learning.on:
        admission["learning"] = proxy.learning.describe()
    return {"admission": admission,
            "configuration": health(proxy.settings.backends, proxy.plans, proxy.learning_plan)}
