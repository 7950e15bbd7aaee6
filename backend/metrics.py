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
    cohort_moe_distinct_experts_before      histogram of the per-(forward, layer) counts, top-k
    cohort_moe_distinct_experts_after       histogram of the per-(forward, layer) counts, policy
    cohort_moe_batch_expert_loads_before_total / _after_total / cohort_moe_batch_layer_forwards_total
                                            the same for the whole batch (all groups together):
                                            phase is prefill, decode or mixed, policy is the one
                                            policy of the batch or "mixed"
    cohort_moe_plugin_cpu_seconds_total     (no labels) worker-thread CPU time spent in the plugin,
    cohort_moe_forward_cpu_seconds_total    and in the model forwards it wraps (plugin included):
                                            the ratio is the plugin's overhead. On CPU backends the
                                            forward's CPU time is its compute; on GPU, its host side

Transport: metrics are produced in vLLM's worker process but served by the API server process.
Workers write them with prometheus_client's multiprocess file format (`MmapedDict`) into
`$PROMETHEUS_MULTIPROC_DIR` when vLLM runs in multiprocess mode (that collector then serves them),
else into a private directory that the API server process created and serves with its own
`MultiProcessCollector` on the default registry (what vLLM's /metrics uses then). A worker
publishes at most every 100 ms, and at once when the engine runs out of work.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
COHORT_DIR_ENV = "COHORT_METRICS_DIR"  # set by the API server process for its children
LABELS = ("phase", "policy")
BUCKETS = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0,
           float("inf"))


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "counter" or "histogram"
    help: str


FAMILIES = {f.name: f for f in (
    Family("cohort_moe_expert_loads_before", "counter",
           "Distinct experts chosen by the router (top-k), summed over forwards and MoE layers"),
    Family("cohort_moe_expert_loads_after", "counter",
           "Distinct experts used after the routing policy, summed over forwards and MoE layers"),
    Family("cohort_moe_layer_forwards", "counter", "(forward, MoE layer) pairs with tokens of this phase and policy"),
    Family("cohort_moe_routed_tokens", "counter", "Tokens routed, counted once per forward"),
    Family("cohort_moe_distinct_experts_before", "histogram",
           "Distinct experts per forward and MoE layer under the router's top-k"),
    Family("cohort_moe_distinct_experts_after", "histogram",
           "Distinct experts per forward and MoE layer after the routing policy"),
    Family("cohort_moe_batch_expert_loads_before", "counter",
           "Distinct experts of the whole batch under top-k, summed over forwards and MoE layers"),
    Family("cohort_moe_batch_expert_loads_after", "counter",
           "Distinct experts of the whole batch after the policies, summed over forwards and MoE layers"),
    Family("cohort_moe_batch_layer_forwards", "counter", "(forward, MoE layer) pairs of whole batches"),
    Family("cohort_moe_plugin_cpu_seconds", "counter",
           "Worker-thread CPU time spent in the moe-cohort plugin (batch bookkeeping, re-routing, metrics, recording)"),
    Family("cohort_moe_forward_cpu_seconds", "counter",
           "Worker-thread CPU time of model forward passes, the plugin's share included"),
)}


SMALL_LAYER = 512  # ids per layer up to which Python sets beat numpy (right after a forward, caches are cold)


def distinct_experts(ids: Sequence[np.ndarray], group: np.ndarray, num_groups: int,
                     num_experts: int) -> list[list[int]]:
    """Distinct experts per token group and for all tokens, per layer.

    ids: L arrays [n, k] (or one [L, n, k] array) of expert ids; group [n] group index of each token
    in [0, num_groups). Returns [L][num_groups + 1]: entry g counts group g's experts, the last entry
    all tokens' experts. Small batches use Python sets, large ones one numpy scatter for all layers.
    """
    if len(ids) == 0:
        return []
    if ids[0].size > SMALL_LAYER:
        return _distinct_numpy(np.stack(ids), group, num_groups, num_experts).tolist()
    if num_groups == 1:
        return [[c, c] for c in (len(set(layer.ravel().tolist())) for layer in ids)]
    groups, counts = group.tolist(), []
    for layer in ids:
        used = [set() for _ in range(num_groups)]
        for g, row in zip(groups, layer.tolist()):
            used[g].update(row)
        counts.append([len(u) for u in used] + [len(set().union(*used))])
    return counts


def _distinct_numpy(ids: np.ndarray, group: np.ndarray, num_groups: int, num_experts: int) -> np.ndarray:
    """`distinct_experts` for ids [L, n, k] as one scatter; returns [L, num_groups + 1]."""
    num_layers = ids.shape[0]
    used = np.zeros((num_layers, num_groups, num_experts), dtype=bool)  # [L, G, E]
    used[np.arange(num_layers)[:, None, None], group[None, :, None], ids] = True
    return np.concatenate([used.sum(2), used.any(1).sum(1, keepdims=True)], axis=1)  # [L, G + 1]


class ExpertLoadMetrics:
    """This process's metric totals; `flush()` writes the changed ones to the multiprocess files.

    `directory` None keeps the totals in memory only (`value()` reads them). Writing costs a few
    microseconds per value, so `flush()` writes at most every `flush_interval` seconds unless forced;
    the plugin forces a flush whenever the engine runs out of work.
    """

    def __init__(self, directory: str | Path | None = None, flush_interval: float = 0.1) -> None:
        self._directory = Path(directory) if directory else None
        self._flush_interval = flush_interval
        self._last_flush = float("-inf")
        self._series: dict[tuple[str, tuple[str, str]], list[str]] = {}  # (family, labels) -> mmap keys
        self._values: dict[str, float] = {}  # mmap key -> total
        self._kinds: dict[str, str] = {}  # mmap key -> "counter" / "histogram"
        self._dirty: set[str] = set()
        self._files: dict[str, object] = {}

    def observe_forward(self, groups: list[tuple[str, str]], tokens: list[int],
                        before: list[list[int]], after: list[list[int]],
                        batch: tuple[str, str], batch_before: list[int], batch_after: list[int]) -> None:
        """Record one forward pass.

        groups [G] (phase, policy); tokens [G]; before/after [L][G] distinct experts per layer and
        group; batch (phase, policy) of the whole batch; batch_before/batch_after [L].
        """
        for g, labels in enumerate(groups):
            col_before = [row[g] for row in before]
            col_after = [row[g] for row in after]
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
        """The current total of one sample, e.g. value("cohort_moe_expert_loads_after_total", "decode", "topk")."""
        labels = {} if phase is None else {"phase": phase, "policy": policy}
        labels.update({"le": le} if le else {})
        family = sample.removesuffix("_total").removesuffix("_sum").removesuffix("_bucket")
        return self._values.get(_mmap_key(family, sample, labels), 0.0)

    def flush(self, force: bool = False) -> None:
        """Write every changed value to this process's `<type>_cohort-<pid>.db` files (at most every
        `flush_interval` seconds unless `force`)."""
        now = time.monotonic()
        if not self._dirty or (not force and now - self._last_flush < self._flush_interval):
            return
        if self._directory is not None:
            for key in self._dirty:
                self._file(self._kinds[key]).write_value(key, self._values[key], 0.0)
        self._dirty.clear()
        self._last_flush = now

    def _keys(self, family: str, labels: tuple[str, ...]) -> list[str]:
        """Counter: [total]; histogram: [sum, bucket 0, bucket 1, ...]. New series start at 0, and a
        new histogram exposes every bucket, as prometheus_client's Histogram does."""
        keys = self._series.get((family, labels))
        if keys is None:
            names = dict(zip(LABELS, labels))
            if FAMILIES[family].kind == "counter":
                keys = [_mmap_key(family, family + "_total", names)]
            else:
                keys = [_mmap_key(family, family + "_sum", names)] + [
                    _mmap_key(family, family + "_bucket", {**names, "le": _go_float(b)}) for b in BUCKETS]
            for key in keys:
                self._values[key], self._kinds[key] = 0.0, FAMILIES[family].kind
            self._dirty.update(keys)
            self._series[(family, labels)] = keys
        return keys

    def _add(self, family: str, labels: tuple[str, ...], amount: float) -> None:
        key = self._keys(family, labels)[0]
        self._values[key] += amount
        self._dirty.add(key)

    def _observe(self, family: str, labels: tuple[str, str], amounts: list[int]) -> None:
        """Histogram observations (multiprocess files hold per-bucket counts, not cumulative ones)."""
        keys = self._keys(family, labels)
        self._values[keys[0]] += sum(amounts)
        self._dirty.add(keys[0])
        for amount in amounts:
            key = keys[1 + bisect.bisect_left(BUCKETS, amount)]
            self._values[key] += 1
            self._dirty.add(key)

    def _file(self, kind: str):
        from prometheus_client.mmap_dict import MmapedDict

        if kind not in self._files:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._files[kind] = MmapedDict(str(self._directory / f"{kind}_cohort-{os.getpid()}.db"))
        return self._files[kind]


def _mmap_key(family: str, sample: str, labels: dict[str, str]) -> str:
    from prometheus_client.mmap_dict import mmap_key

    return mmap_key(family, sample, list(labels), list(labels.values()), FAMILIES[family].help)


@functools.cache
def _go_float(value: float) -> str:
    """Prometheus' spelling of a bucket bound ("4.0", "+Inf"); cached, called per observation."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(value)


def worker_directory() -> Path | None:
    """Where this process writes its metric files: vLLM's multiprocess dir, else the API server's."""
    path = os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(COHORT_DIR_ENV)
    return Path(path) if path else None


def setup_serving_process() -> None:
    """In the first process that loads the plugin (the API server), make worker metrics servable.

    With `PROMETHEUS_MULTIPROC_DIR` set, vLLM's /metrics already merges every file in it. Without
    it, create a private directory, export it to child processes as `COHORT_METRICS_DIR`, and
    register a `MultiProcessCollector` over it on the default registry, which /metrics serves.
    Idempotent; child processes inherit the variable and do nothing here.
    """
    if os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(COHORT_DIR_ENV):
        return
    from prometheus_client import REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = tempfile.mkdtemp(prefix="cohort-metrics-")
    os.environ[COHORT_DIR_ENV] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    MultiProcessCollector(REGISTRY, path=directory)
    log.info("moe-cohort metrics: worker files in %s, served on the default Prometheus registry", directory)
