"""send/backend_metrics.py on prometheus_client's own exposition text, as vLLM's /metrics serves it."""

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from moe_cohort.send.backend_metrics import decode_rates, decode_sums, has_plugin_counters, metric_sum


def _plugin_registry() -> tuple[CollectorRegistry, dict[str, Counter]]:
    r = CollectorRegistry()
    names = ("cohort_moe_expert_loads_after", "cohort_moe_layer_forwards", "cohort_moe_routed_tokens")
    return r, {n: Counter(n, n, ["phase", "policy"], registry=r) for n in names}


def test_metric_sum_adds_the_samples_whose_labels_match():
    r = CollectorRegistry()
    loads = Counter("cohort_moe_expert_loads_after", "loads", ["phase", "layer"], registry=r)
    loads.labels("decode", "0").inc(3)
    loads.labels("decode", "1").inc(4)
    loads.labels("prefill", "0").inc(100)
    Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=r).labels("tiny").set(7)
    text = generate_latest(r).decode()
    assert metric_sum(text, "cohort_moe_expert_loads_after_total", phase="decode") == 7
    assert metric_sum(text, "cohort_moe_expert_loads_after_total") == 107
    assert metric_sum(text, "cohort_moe_expert_loads_after_total", phase="decode", layer="1") == 4
    assert metric_sum(text, "cohort_moe_expert_loads_after_total", phase="mixed") == 0
    assert metric_sum(text, "vllm:num_requests_waiting") == 7
    assert metric_sum(text, "cohort_not_there_total") == 0
    assert metric_sum("", "cohort_moe_expert_loads_after_total") == 0


def test_decode_sums_and_rates_sum_the_decode_groups_of_every_policy():
    r, c = _plugin_registry()
    text0 = generate_latest(r).decode()
    for policy, loads, forwards, tokens in [("topk", 30, 8, 10), ("xshare;m=8", 10, 4, 2)]:
        c["cohort_moe_expert_loads_after"].labels("decode", policy).inc(loads)
        c["cohort_moe_layer_forwards"].labels("decode", policy).inc(forwards)
        c["cohort_moe_routed_tokens"].labels("decode", policy).inc(tokens)
        c["cohort_moe_routed_tokens"].labels("prefill", policy).inc(1000)  # prefill never counts
    before, after = decode_sums(text0), decode_sums(generate_latest(r).decode())
    assert before == {"loads": 0, "forwards": 0, "tokens": 0}
    assert after == {"loads": 40, "forwards": 12, "tokens": 12}
    assert decode_rates(before, after, layers=4) == (40 / 12, 12 * 4 / 12)  # loads per token, tokens per forward
    assert decode_rates(before, after, layers=None) == (40 / 12, None)
    per_token, per_forward = decode_rates(after, after, layers=4)  # nothing decoded between them
    assert math.isnan(per_token) and per_forward is None


def test_plugin_counters_are_seen_by_their_families_even_before_a_sample():
    r, _ = _plugin_registry()
    assert has_plugin_counters(generate_latest(r).decode())
    vllm_only = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "waiting", registry=vllm_only).set(0)
    assert not has_plugin_counters(generate_latest(vllm_only).decode())
    assert not has_plugin_counters("")
