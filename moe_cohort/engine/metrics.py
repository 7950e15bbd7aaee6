"""Live expert-load metrics of the vLLM plugin, exported to Prometheus.

Per forward pass and MoE layer the plugin counts the distinct experts the tokens use before
(the router's top-k) and after the routing policy, per group of tokens with the same phase
(`prefill`/`decode`) and policy, and for the whole batch. The sums are the "expert loads" of
Doubleword's co-activation study; `1 - after / before` is the saving a policy buys.

Metric families (labels `phase`, `policy`; policy is the canonical policy string):

    cohort_moe_expert_loads_before_total    distinct experts of the group's tokens under top-k,
                                            summed over forwards and layers
    cohort_moe_expert_loads_after_total     the same after the policy (what the engine loaded)
    cohort_moe_layer_forwards_total         (forward, layer) pairs in which the group had tokens
    cohort_moe_routed_tokens_total          tokens of the group, counted once per forward
    cohort_moe_distinct_experts_before      histograms of the per-(forward, layer) counts, top-k
    cohort_moe_distinct_experts_after       and policy
    cohort_moe_batch_expert_loads_before_total / _after_total / cohort_moe_batch_layer_forwards_total
                                            the same for the whole batch: phase prefill, decode or
                                            mixed, policy the batch's one policy or "mixed"
    cohort_moe_plugin_cpu_seconds_total     (no labels) worker-thread CPU time in the plugin, and
    cohort_moe_forward_cpu_seconds_total    in the model forwards it wraps (plugin included): the
                                            ratio is the plugin's overhead (on GPU, the host side)
    cohort_engine_info                      (gauge, value 1) what the engine is, as labels
                                            (engine.engine_info.info_labels); set by the API server

Transport: counted in vLLM's worker process, served by the API server process, one of two ways:
- prometheus_client's multiprocess mode, if this process runs in it (PROMETHEUS_MULTIPROC_DIR set
  before prometheus_client was imported: by the user, or by vLLM for --api-server-count > 1):
  every update also goes to a `Counter`/`Histogram`, i.e. to that directory, and vLLM's /metrics
  serves it (`MultiProcessCollector`). That costs an mmap write per update, far
  more per forward than counting in memory (docs/results.md).
  Dead processes' totals stay: no `mark_process_dead` (it only drops live gauges; we have none).
- else (vLLM's default; the worker is forked from the API server, so its prometheus_client
  counts in memory) the API server makes a private directory (`COHORT_METRICS_DIR`, inherited by
  its children); each worker writes its totals there (`write_to_textfile`) at most
  once a second while busy and whenever the engine runs out of work; a `SnapshotCollector` on
  the default registry (what vLLM's /metrics serves then) sums the files.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values, write_to_textfile
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
COHORT_DIR_ENV = "COHORT_METRICS_DIR"  # set by the API server process for its children
ENGINE_INFO = "cohort_engine_info"
LABELS = ("phase", "policy")
BUCKETS = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, float("inf"))
_SUMMED = ", summed over forwards and MoE layers"
COUNTERS = {  # name -> help; the two CPU-time counters have no labels
    "cohort_moe_expert_loads_before": "Distinct experts chosen by the router (top-k)" + _SUMMED,
    "cohort_moe_expert_loads_after": "Distinct experts used after the routing policy" + _SUMMED,
    "cohort_moe_layer_forwards": "(forward, MoE layer) pairs with tokens of this phase and policy",
    "cohort_moe_routed_tokens": "Tokens routed, counted once per forward",
    "cohort_moe_batch_expert_loads_before": "Distinct experts of the whole batch under top-k" + _SUMMED,
    "cohort_moe_batch_expert_loads_after": "Distinct experts of the whole batch after the policies" + _SUMMED,
    "cohort_moe_batch_layer_forwards": "(forward, MoE layer) pairs of whole batches",
    "cohort_moe_plugin_cpu_seconds": "Worker-thread CPU time spent in the moe-cohort plugin "
                                     "(batch bookkeeping, re-routing, metrics, recording)",
    "cohort_moe_forward_cpu_seconds": "Worker-thread CPU time of model forward passes, the plugin's share included",
}
UNLABELLED = ("cohort_moe_plugin_cpu_seconds", "cohort_moe_forward_cpu_seconds")
_BOUNDS = [floatToGoString(b) for b in BUCKETS]  # "1.0", ..., "+Inf": the `le` labels
HISTOGRAMS = {
    "cohort_moe_distinct_experts_before": "Distinct experts per forward and MoE layer under the router's top-k",
    "cohort_moe_distinct_experts_after": "Distinct experts per forward and MoE layer after the routing policy",
}


class _Totals:
    """This process's totals, in memory, as a prometheus_client custom collector."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[tuple, float]] = {name: {} for name in COUNTERS}  # name -> labels -> total
        # name -> labels -> [sum, per-bucket counts (not cumulative) ...]
        self.histograms: dict[str, dict[tuple, list[float]]] = {name: {} for name in HISTOGRAMS}

    def collect(self) -> Iterator[Metric]:
        for name, series in self.counters.items():
            family = CounterMetricFamily(name, COUNTERS[name], labels=() if name in UNLABELLED else LABELS)
            for labels, total in series.items():
                family.add_metric(labels, total)
            yield family
        for name, series in self.histograms.items():
            family = HistogramMetricFamily(name, HISTOGRAMS[name], labels=LABELS)
            for labels, (total, *counts) in series.items():
                family.add_metric(labels, list(zip(_BOUNDS, itertools.accumulate(counts))), total)
            yield family


class ExpertLoadMetrics:
    """This process's expert-load metrics; `flush()` publishes them where the API server reads them.

    Totals are kept in memory (`value()` reads them). In prometheus_client's multiprocess mode
    every update also goes to a `Counter`/`Histogram` in PROMETHEUS_MULTIPROC_DIR at once. Else,
    given a `directory`, `flush()` writes a snapshot `<directory>/cohort-<pid>.prom` at most every
    `flush_interval` s unless forced (the plugin forces one whenever the engine runs out of work).
    """

    def __init__(self, directory: str | Path | None = None, flush_interval: float = 1.0) -> None:
        self._totals = _Totals()
        self._registry = CollectorRegistry()
        self._registry.register(self._totals)
        # prometheus_client picks in-memory or multiprocess values once, when imported (from
        # PROMETHEUS_MULTIPROC_DIR then), so the variable alone does not tell which this process uses
        self._shared = {} if not getattr(values.ValueClass, "_multiprocess", False) else {
            **{n: Counter(n, text, () if n in UNLABELLED else LABELS, registry=None) for n, text in COUNTERS.items()},
            **{n: Histogram(n, text, LABELS, buckets=BUCKETS, registry=None) for n, text in HISTOGRAMS.items()}}
        self._children: dict[tuple[str, tuple], object] = {}  # (family, labels) -> labelled child of _shared
        self._directory = Path(directory) if directory is not None and not self._shared else None
        if self._directory is not None and os.environ.get(PROMETHEUS_DIR_ENV):
            log.warning("%s was set after prometheus_client was imported in pid %d: its expert-load metrics "
                        "will not reach /metrics", PROMETHEUS_DIR_ENV, os.getpid())
        self._flush_interval, self._last_flush, self._dirty = flush_interval, float("-inf"), False

    def observe_forward(self, groups: list[tuple[str, str]], tokens: list[int],
                        before: list[list[int]], after: list[list[int]],
                        batch: tuple[str, str], batch_before: list[int], batch_after: list[int]) -> None:
        """Record one forward pass.

        groups [G] (phase, policy); tokens [G]; before/after [L][G] distinct experts per layer and
        group; batch (phase, policy) of the whole batch; batch_before/batch_after [L].
        """
        for g, labels in enumerate(groups):
            col_before = [row[g] for row in before]  # [L]
            col_after = [row[g] for row in after]  # [L]
            self._add("cohort_moe_expert_loads_before", labels, sum(col_before))
            self._add("cohort_moe_expert_loads_after", labels, sum(col_after))
            self._add("cohort_moe_layer_forwards", labels, len(col_before))
            self._add("cohort_moe_routed_tokens", labels, tokens[g])
            self._observe("cohort_moe_distinct_experts_before", labels, col_before)
            self._observe("cohort_moe_distinct_experts_after", labels, col_after)
        self._add("cohort_moe_batch_expert_loads_before", batch, sum(batch_before))
        self._add("cohort_moe_batch_expert_loads_after", batch, sum(batch_after))
        self._add("cohort_moe_batch_layer_forwards", batch, len(batch_before))

    def add_time(self, plugin_seconds: float, forward_seconds: float) -> None:
        """CPU time spent in the plugin and in model forwards (its overhead, visible in production)."""
        self._add("cohort_moe_plugin_cpu_seconds", (), plugin_seconds)
        self._add("cohort_moe_forward_cpu_seconds", (), forward_seconds)

    def value(self, sample: str, phase: str | None = None, policy: str | None = None, le: str | None = None) -> float:
        """This process's total of one sample, e.g. value("cohort_moe_expert_loads_after_total", "decode", "topk");
        histogram buckets are cumulative, as /metrics shows them. 0 for a series never updated."""
        labels = {} if phase is None else {"phase": phase, "policy": policy}
        labels.update({"le": le} if le else {})
        return self._registry.get_sample_value(sample, labels) or 0.0

    def flush(self, force: bool = False) -> None:
        """Write the snapshot file if anything changed (at most every `flush_interval` s unless `force`)."""
        now = time.monotonic()
        if self._directory is None or not self._dirty or (not force and now - self._last_flush < self._flush_interval):
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self._directory / f"cohort-{os.getpid()}.prom"), self._registry)
        self._dirty, self._last_flush = False, now

    def _add(self, family: str, labels: tuple[str, ...], amount: float) -> None:
        series = self._totals.counters[family]
        series[labels] = series.get(labels, 0.0) + amount
        self._dirty = True
        if self._shared:
            self._child(family, labels).inc(amount)

    def _observe(self, family: str, labels: tuple[str, str], amounts: list[int]) -> None:
        """Histogram observations (kept per bucket, made cumulative when collected)."""
        sums = self._totals.histograms[family].setdefault(labels, [0.0] * (len(BUCKETS) + 1))
        sums[0] += sum(amounts)
        for amount in amounts:
            sums[1 + bisect.bisect_left(BUCKETS, amount)] += 1
        if self._shared:
            child = self._child(family, labels)
            for amount in amounts:
                child.observe(amount)

    def _child(self, family: str, labels: tuple[str, ...]):
        child = self._children.get((family, labels))
        if child is None:
            metric = self._shared[family]
            child = self._children[(family, labels)] = metric.labels(*labels) if labels else metric
        return child


class SnapshotCollector:
    """A prometheus_client collector serving the sum of every `*.prom` snapshot in `directory`:
    samples with the same name and labels are added across files (counters, histogram buckets,
    counts and sums all sum across processes)."""

    def __init__(self, directory: str | Path) -> None:
        self._directory = Path(directory)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        for path in sorted(self._directory.glob("*.prom")):
            for family in text_string_to_metric_families(path.read_text(encoding="utf-8")):
                families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    totals[family.name][(s.name, tuple(s.labels.items()))] += s.value
        for name, metric in families.items():
            for (sample, labels), total in totals[name].items():
                metric.add_sample(sample, dict(labels), total)
            yield metric


def worker_directory() -> Path | None:
    """Where this process's metrics go: vLLM's multiprocess dir, else the API server's."""
    path = os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(COHORT_DIR_ENV)
    return Path(path) if path else None


def setup_serving_process() -> None:
    """In the first process that loads the plugin (the API server), make worker metrics servable.

    With `PROMETHEUS_MULTIPROC_DIR` set, vLLM's /metrics already merges every file in it. Without
    it, create a private directory, export it to child processes as `COHORT_METRICS_DIR`, and
    register a `SnapshotCollector` over it on the default registry, which /metrics serves.
    Idempotent; child processes inherit the variable and do nothing here.
    """
    if os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(COHORT_DIR_ENV):
        return
    from prometheus_client import REGISTRY

    directory = tempfile.mkdtemp(prefix="cohort-metrics-")
    os.environ[COHORT_DIR_ENV] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    REGISTRY.register(SnapshotCollector(directory))
    log.info("moe-cohort metrics: worker snapshots in %s, served on the default Prometheus registry", directory)


_engine_info: Gauge | None = None  # registered once per process


def publish_engine_info(labels: dict[str, str]) -> None:
    """Serve `cohort_engine_info{labels} 1` on /metrics (the default registry), replacing this process's
    previous series. In multiprocess mode the value goes to PROMETHEUS_MULTIPROC_DIR; "max" shows one
    series for API servers with the same labels, without a pid label, and keeps it when one exits."""
    global _engine_info
    if _engine_info is None:
        _engine_info = Gauge(ENGINE_INFO, "What this vLLM engine with moe-cohort is (the labels); always 1",
                             tuple(labels), multiprocess_mode="max")
    _engine_info.clear()  # another engine built in this process describes itself anew
    _engine_info.labels(**labels).set(1)
