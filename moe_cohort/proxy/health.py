"""`GET /health` of the proxy: its status, and for callers allowed to see the backends what it serves and how.

    200 {"status": "ok", "backend": URL, "admission": {...}, "configuration": {...}}
    503 {"status": "backend unavailable", "backend": URL, "detail": "..."}
    several replicas: {"status": "ok" | "degraded" | "backend unavailable", "routing", "replicas": [...], ...}

With --protect-metrics a caller without a key gets the status alone: load balancers may probe, but the
backends' addresses, errors and the admission's state are for key holders.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moe_cohort.proxy.autoconfig import health
from moe_cohort.proxy.http.errors import ProxyError


async def health_answer(proxy, request: Request) -> Response:
    """The answer of `proxy` (proxy.app.Proxy) to `request`; one backend is asked its own /health now."""
    settings = proxy.settings
    shown = not settings.protect_metrics or proxy.authorize.allows(request.headers)
    if proxy.replicas.size > 1:
        return await _replicas_health(proxy, shown)
    try:
        await proxy.backend.request("GET", "/health")
    except ProxyError as exc:
        return JSONResponse({"status": "backend unavailable", **({"backend": settings.backend_url,
                             "detail": exc.message} if shown else {})}, status_code=503)
    return JSONResponse({"status": "ok", **({"backend": settings.backend_url, **admission_health(proxy)}
                                            if shown else {})})


def admission_health(proxy) -> dict:
    """What admission runs on (a learned head, a trained folder's, embeddings only, or nothing: FCFS) and how each
    replica is served (proxy/autoconfig.py)."""
    if proxy.predictor is None:
        admission = {"mode": "first come, first served (--encoder none)"}
    else:
        admission = {"mode": proxy.predictor.mode()}
    if proxy.learning is not None and proxy.learning.on:
        admission["learning"] = proxy.learning.describe()
    return {"admission": admission,
            "configuration": health(proxy.settings.backend_urls, proxy.plans, proxy.learning_plan)}


async def _replicas_health(proxy, shown: bool) -> Response:
    """Several replicas: each probed now (and taken out or back in by the answer); 200 while one is up."""
    up = await proxy.replicas.check()
    router = proxy.replicas.router
    replicas = [{"backend": c.base_url, "healthy": ok, "in_flight": int(busy), "max_in_flight": int(cap)}
                for c, ok, busy, cap in zip(proxy.replicas.clients, up, router.busy, router.capacity)]
    status = "ok" if all(up) else "degraded" if any(up) else "backend unavailable"
    return JSONResponse({"status": status, **({"routing": router.routing, "replicas": replicas,
                                               **admission_health(proxy)} if shown else {})},
                        status_code=200 if any(up) else 503)
