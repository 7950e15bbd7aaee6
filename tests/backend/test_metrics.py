"""Distinct-expert counting and the Prometheus multiprocess files (real prometheus_client)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from backend.metrics import ExpertLoadMetrics, distinct_experts


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("n", [13, 300])  # Python sets below SMALL_LAYER ids per layer, numpy above
def test_distinct_experts_matches_brute_force(g, n):
    rng = np.random.default_rng(g)
    for _ in range(10):
        layers, k, e = 3, 3, 10
        ids = rng.integers(0, e, (layers, n, k))
        group = rng.integers(0, g, n)
        got = distinct_experts(list(ids), group, g, e)
        assert got == distinct_experts(ids, group, g, e)  # a list of layers or one array
        expected = [[len({x for t in range(n) if group[t] == gi for x in ids[layer, t]}) for gi in range(g)]
                    + [len(set(ids[layer].ravel()))] for layer in range(layers)]
        assert got == expected


def _observe(metrics: ExpertLoadMetrics) -> None:
    # 2 layers; groups: (decode, topk) and (decode, lynx)
    metrics.observe_forward(
        groups=[("decode", "topk"), ("decode", "lynx-lat;drop=2")], tokens=[3, 2],
        before=[[5, 4], [6, 3]], after=[[5, 2], [6, 1]], batch=("decode", "mixed"),
        batch_before=[8, 8], batch_after=[6, 7])


def test_totals_in_memory():
    metrics = ExpertLoadMetrics()
    _observe(metrics)
    _observe(metrics)
    assert metrics.value("cohort_moe_expert_loads_before_total", "decode", "topk") == 22
    assert metrics.value("cohort_moe_expert_loads_after_total", "decode", "lynx-lat;drop=2") == 6
    assert metrics.value("cohort_moe_layer_forwards_total", "decode", "topk") == 4
    assert metrics.value("cohort_moe_routed_tokens_total", "decode", "lynx-lat;drop=2") == 4
    assert metrics.value("cohort_moe_batch_expert_loads_after_total", "decode", "mixed") == 26
    assert metrics.value("cohort_moe_distinct_experts_after_bucket", "decode", "lynx-lat;drop=2", le="1.0") == 2
    assert metrics.value("cohort_moe_distinct_experts_after_bucket", "decode", "lynx-lat;drop=2", le="2.0") == 2
    assert metrics.value("cohort_moe_distinct_experts_after_sum", "decode", "lynx-lat;drop=2") == 6


def _write_from_another_process(directory) -> None:
    code = ("import sys; from backend.metrics import ExpertLoadMetrics; m = ExpertLoadMetrics(sys.argv[1]); "
            "m.observe_forward([('decode', 'topk')], [4], [[7], [5]], [[7], [5]], ('decode', 'topk'), [7, 5], [7, 5]); "
            "m.flush()")
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, cwd=os.getcwd())


def test_files_are_served_by_prometheus_multiprocess_collector(tmp_path):
    metrics = ExpertLoadMetrics(tmp_path)
    _observe(metrics)
    metrics.flush()
    _write_from_another_process(tmp_path)  # a second worker process adds to the same families
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    get = registry.get_sample_value
    labels = {"phase": "decode", "policy": "topk"}
    assert get("cohort_moe_expert_loads_before_total", labels) == 11 + 12
    assert get("cohort_moe_layer_forwards_total", labels) == 2 + 2
    assert get("cohort_moe_distinct_experts_before_count", labels) == 4
    assert get("cohort_moe_distinct_experts_before_bucket", {**labels, "le": "4.0"}) == 0
    assert get("cohort_moe_distinct_experts_before_bucket", {**labels, "le": "8.0"}) == 4  # cumulative
    assert get("cohort_moe_distinct_experts_before_sum", labels) == 23
    lynx = {"phase": "decode", "policy": "lynx-lat;drop=2"}
    assert get("cohort_moe_expert_loads_after_total", lynx) == 3
    text = generate_latest(registry).decode()
    assert "# HELP cohort_moe_expert_loads_after_total Distinct experts used after the routing policy" in text
    assert "# TYPE cohort_moe_distinct_experts_after histogram" in text


def _served(directory, sample="cohort_moe_expert_loads_before_total", labels=None):
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry.get_sample_value(sample, labels or {"phase": "decode", "policy": "topk"})


def test_flush_is_rate_limited_unless_forced(tmp_path):
    metrics = ExpertLoadMetrics(tmp_path, flush_interval=3600)
    _observe(metrics)
    metrics.flush()  # the first flush writes
    assert _served(tmp_path) == 11
    _observe(metrics)
    metrics.flush()  # within the interval: kept in memory
    assert _served(tmp_path) == 11 and metrics.value("cohort_moe_expert_loads_before_total", "decode", "topk") == 22
    metrics.flush(force=True)  # what the plugin does when the engine goes idle
    assert _served(tmp_path) == 22


@pytest.mark.parametrize("env", [{}, {"PROMETHEUS_MULTIPROC_DIR": "/x"}, {"COHORT_METRICS_DIR": "/y"}])
def test_worker_directory_prefers_vllm_multiprocess_dir(monkeypatch, env):
    from backend.metrics import worker_directory

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("COHORT_METRICS_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    expected = env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("COHORT_METRICS_DIR")
    assert (str(worker_directory()) if worker_directory() else None) == expected
