"""benchmarks/bench_proxy's reading of /metrics (shared with bench_learning_e2e), on prometheus_client's own output."""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from benchmarks.bench_proxy import metric_sum


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
    assert metric_sum(text, "vllm:num_requests_waiting") == 7
    assert metric_sum(text, "cohort_not_there_total") == 0
