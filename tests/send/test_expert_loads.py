"""The plugin's batch counters read from a server's Prometheus text, among vLLM's own families."""

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from moe_cohort.send.expert_loads import ExpertLoads, parse_expert_loads


def metrics_text(rng) -> tuple[str, dict[str, float]]:
    """Prometheus text with the plugin's three batch counters (two phases, two policies) beside a large histogram,
    and the decode totals a brute-force sum gives."""
    registry = CollectorRegistry()
    counters = {key: Counter(f"cohort_moe_batch_{name}", key, ["phase", "policy"], registry=registry)
                for key, name in (("before", "expert_loads_before"), ("after", "expert_loads_after"),
                                  ("forwards", "layer_forwards"))}
    noise = Histogram("vllm:time_to_first_token_seconds", "noise", ["model_name"], registry=registry,
                      buckets=[0.001 * 2 ** i for i in range(30)])
    want = dict.fromkeys(counters, 0.0)
    for key, counter in counters.items():
        for phase in ("decode", "prefill"):
            for policy in ("topk", "oea"):
                value = float(rng.integers(1, 1000))
                counter.labels(phase, policy).inc(value)
                want[key] += value if phase == "decode" else 0.0
    for model in range(20):
        noise.labels(f"m{model}").observe(float(rng.random()))
    return generate_latest(registry).decode(), want


def test_decode_totals_are_summed_over_policies_and_only_decode_counts():
    text, want = metrics_text(np.random.default_rng(0))
    assert parse_expert_loads(text) == ExpertLoads(**want)
    assert parse_expert_loads("") == ExpertLoads()
