"""The engine handshake as replicas answer it: an /v1/cohort/info body (`info`), a /metrics text with the plugin's
info series (`metrics_text`), and the EngineInfo of our scheduler with counts (AWARE), vLLM's scheduler with
the plugin (OURS) and a plain vLLM (PLAIN_VLLM)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from moe_cohort.send.handshake import METRICS, PLAIN, ROUTE, EngineInfo


def info(max_num_seqs=16, expert_aware=True, observed=True, **changes) -> dict:
    body = {"object": "cohort.engine_info", "schema": 1, "plugin_version": "0.1.0", "vllm_version": "0.32.0",
            "model": "tiny", "moe": {"layers": 4, "experts": 64, "top_k": 4}, "max_num_seqs": max_num_seqs,
            "scheduler": {"expert_aware": expert_aware, "class": "x", "base": "Scheduler"},
            "observed_counts": observed, "policies": ["topk", "xshare"]}
    return {**body, **changes}


def metrics_text(**labels) -> str:
    """A /metrics exposition with the plugin's info series (as the general plugin publishes it) beside vLLM's own."""
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(3)
    if labels:
        Gauge("cohort_engine_info", "moe-cohort engine", list(labels), registry=registry).labels(**labels).set(1)
    return generate_latest(registry).decode()


AWARE, OURS, PLAIN_VLLM = EngineInfo(ROUTE, 16, (4, 64, 4), True, True), EngineInfo(METRICS, 16, None, False, False), \
    EngineInfo(PLAIN)
