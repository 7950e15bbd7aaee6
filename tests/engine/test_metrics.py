"""Expert-load totals, and both ways worker metrics reach /metrics (real prometheus_client, real processes)."""

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from moe_cohort.engine.metrics import ExpertLoadMetrics, SnapshotCollector
from tests.helpers.worker_metrics import observe_sample_forward


def test_totals_in_memory():
    metrics = ExpertLoadMetrics()
    observe_sample_forward(metrics)
    observe_sample_forward(metrics)
    assert metrics.value("cohort_moe_expert_loads_before_total", "decode", "topk") == 22
    assert metrics.value("cohort_moe_expert_loads_after_total", "decode", "lynx-lat;drop=2") == 6
    assert metrics.value("cohort_moe_layer_forwards_total", "decode", "topk") == 4
    assert metrics.value("cohort_moe_routed_tokens_total", "decode", "lynx-lat;drop=2") == 4
    assert metrics.value("cohort_moe_batch_expert_loads_after_total", "decode", "mixed") == 26
    assert metrics.value("cohort_moe_distinct_experts_after_bucket", "decode", "lynx-lat;drop=2", le="1.0") == 2
    assert metrics.value("cohort_moe_distinct_experts_after_bucket", "decode", "lynx-lat;drop=2", le="2.0") == 4
    assert metrics.value("cohort_moe_distinct_experts_after_sum", "decode", "lynx-lat;drop=2") == 6


def _write_in_processes(directory, multiprocess_mode: bool) -> None:
    """Two worker processes, in prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set
    before it is imported) or not (vLLM's default: snapshots in `directory`)."""
    directory.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "COHORT_METRICS_DIR")}
    if multiprocess_mode:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    for which in ("a", "b"):
        code = "import sys; from tests.helpers.worker_metrics import write; write(sys.argv[1], sys.argv[2])"
        subprocess.run([sys.executable, "-c", code, str(directory), which], check=True, cwd=os.getcwd(), env=env)


def _served_by(collector_type, directory) -> CollectorRegistry:
    registry = CollectorRegistry()
    if collector_type is MultiProcessCollector:
        MultiProcessCollector(registry, path=str(directory))
    else:
        registry.register(SnapshotCollector(directory))
    return registry


@pytest.mark.integration
@pytest.mark.parametrize("multiprocess_mode", [True, False])
def test_two_worker_processes_are_summed_on_metrics(tmp_path, multiprocess_mode):
    _write_in_processes(tmp_path, multiprocess_mode)
    assert {p.suffix for p in tmp_path.iterdir()} == ({".db"} if multiprocess_mode else {".prom"})
    registry = _served_by(MultiProcessCollector if multiprocess_mode else SnapshotCollector, tmp_path)
    get = registry.get_sample_value
    labels = {"phase": "decode", "policy": "topk"}
    assert get("cohort_moe_expert_loads_before_total", labels) == 11 + 12
    assert get("cohort_moe_layer_forwards_total", labels) == 2 + 2
    assert get("cohort_moe_distinct_experts_before_count", labels) == 4
    assert get("cohort_moe_distinct_experts_before_bucket", {**labels, "le": "4.0"}) == 0
    assert get("cohort_moe_distinct_experts_before_bucket", {**labels, "le": "8.0"}) == 4  # cumulative
    assert get("cohort_moe_distinct_experts_before_sum", labels) == 23
    assert get("cohort_moe_expert_loads_after_total", {"phase": "decode", "policy": "lynx-lat;drop=2"}) == 3
    assert get("cohort_moe_batch_expert_loads_after_total", {"phase": "decode", "policy": "mixed"}) == 13
    assert get("cohort_moe_plugin_cpu_seconds_total") == 0.5 and get("cohort_moe_forward_cpu_seconds_total") == 3.0
    text = generate_latest(registry).decode()
    assert "# HELP cohort_moe_expert_loads_after_total Distinct experts used after the routing policy" in text
    assert "# TYPE cohort_moe_distinct_experts_after histogram" in text
    assert "# TYPE cohort_moe_routed_tokens_total counter" in text and "_created" not in text


def _samples(registry) -> set:
    return {(s.name, tuple(sorted(s.labels.items())), s.value) for m in registry.collect() for s in m.samples}


@pytest.mark.integration
def test_both_transports_serve_the_same_samples(tmp_path):
    """What /metrics shows does not depend on how the worker's numbers reached the API server."""
    _write_in_processes(tmp_path / "mp", multiprocess_mode=True)
    _write_in_processes(tmp_path / "snap", multiprocess_mode=False)
    native = _samples(_served_by(MultiProcessCollector, tmp_path / "mp"))
    assert len(native) > 50
    assert _samples(_served_by(SnapshotCollector, tmp_path / "snap")) == native


@pytest.mark.integration
def test_setup_serving_process_serves_worker_snapshots_on_the_default_registry(tmp_path):
    code = ("from prometheus_client import REGISTRY, generate_latest\n"
            "from moe_cohort.engine.metrics import ExpertLoadMetrics, setup_serving_process, worker_directory\n"
            "setup_serving_process(); setup_serving_process()  # idempotent\n"
            "from tests.helpers.worker_metrics import write\n"
            "write(str(worker_directory()), 'a')\n"
            "print(generate_latest(REGISTRY).decode())")
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "COHORT_METRICS_DIR")}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd(), env=env,
                         capture_output=True, text=True).stdout
    assert 'cohort_moe_expert_loads_before_total{phase="decode",policy="topk"} 11.0' in out
    assert "python_info" in out  # the default registry's own collectors are still there


def _snapshot_value(directory, sample="cohort_moe_expert_loads_before_total", labels=None):
    registry = _served_by(SnapshotCollector, directory)
    return registry.get_sample_value(sample, labels or {"phase": "decode", "policy": "topk"})


def test_snapshots_are_rate_limited_unless_forced(tmp_path):
    metrics = ExpertLoadMetrics(tmp_path, flush_interval=3600)
    observe_sample_forward(metrics)
    metrics.flush()  # the first flush writes
    assert _snapshot_value(tmp_path) == 11
    observe_sample_forward(metrics)
    metrics.flush()  # within the interval: kept in memory
    assert _snapshot_value(tmp_path) == 11 and metrics.value("cohort_moe_expert_loads_before_total", "decode", "topk") == 22
    metrics.flush(force=True)  # what the plugin does when the engine goes idle
    assert _snapshot_value(tmp_path) == 22


@pytest.mark.parametrize("env", [{}, {"PROMETHEUS_MULTIPROC_DIR": "/x"}, {"COHORT_METRICS_DIR": "/y"}])
def test_worker_directory_prefers_vllm_multiprocess_dir(monkeypatch, env):
    from moe_cohort.engine.metrics import worker_directory

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("COHORT_METRICS_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    expected = env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("COHORT_METRICS_DIR")
    assert (str(worker_directory()) if worker_directory() else None) == expected


INFO_A = {"model": "tiny", "observed_counts": "false"}
INFO_B = {"model": "tiny", "observed_counts": "true"}


def test_engine_info_is_one_series_on_the_default_registry():
    from prometheus_client import REGISTRY

    from moe_cohort.engine.metrics import publish_engine_info

    publish_engine_info(INFO_A)
    publish_engine_info(INFO_B)  # a second engine config in one process: registered once, replaced
    assert REGISTRY.get_sample_value("cohort_engine_info", INFO_B) == 1.0
    assert REGISTRY.get_sample_value("cohort_engine_info", INFO_A) is None
    assert 'cohort_engine_info{model="tiny",observed_counts="true"} 1.0' in generate_latest(REGISTRY).decode()


@pytest.mark.integration
def test_engine_info_reaches_metrics_in_multiprocess_mode(tmp_path):
    """Two API server processes in prometheus_client's multiprocess mode: /metrics (MultiProcessCollector, as vLLM
    serves it then) shows one series, without a pid label."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env.pop("COHORT_METRICS_DIR", None)
    code = f"from moe_cohort.engine.metrics import publish_engine_info; publish_engine_info({INFO_B!r})"
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
    samples = [s for m in _served_by(MultiProcessCollector, tmp_path).collect() for s in m.samples]
    assert [(s.name, s.labels, s.value) for s in samples] == [("cohort_engine_info", INFO_B, 1.0)]
