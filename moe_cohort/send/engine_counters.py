"""The moe-cohort plugin's decode counters, read from a vLLM server's Prometheus /metrics (engine/metrics.py
counts them and documents their families).

One reading holds six decode-phase sums, each summed over policies (`phase="decode"`):

    batch_before       cohort_moe_batch_expert_loads_before_total   distinct experts per (forward, MoE layer)
    batch_after        cohort_moe_batch_expert_loads_after_total    of whole pure-decode batches, under top-k /
                                                                    after the routing policy, summed
    batch_layer_steps  cohort_moe_batch_layer_forwards_total        (forward, MoE layer) pairs of those batches
    loads              cohort_moe_expert_loads_after_total          distinct experts of the decode tokens after
                                                                    the policy, summed over forwards and layers
    layer_forwards     cohort_moe_layer_forwards_total              (forward, MoE layer) pairs with decode tokens
    tokens             cohort_moe_routed_tokens_total               decode tokens, once per forward (generated)

Readings of several replicas add; the difference of two readings of one server is what its engine ran
between them. From such a difference:

    experts_per_layer_step   batch_after / batch_layer_steps: experts loaded per MoE layer in a decode step
                             (what expert-coherent batching lowers)
    policy_saving            1 - batch_after / batch_before: what the routing policy removed on top
    loads_per_token          loads / tokens: decode expert loads per GENERATED token
    tokens_per_forward(L)    tokens * L / layer_forwards: decode tokens per forward, L = the model's MoE layers

Compare policies per generated token, never per forward: one that leaves slots empty touches fewer experts
per forward and loses throughput. The counters are server-wide: other traffic on the server counts too.

Readers: `parse_counters(text)`; `fetch_counters(replicas)` (async, over send.backend_client.BackendClient);
`read_counters(url)` / `read_metrics(url)` for synchronous callers (an aiohttp GET in its own event loop;
MetricsUnreadable when it fails). asyncio and aiohttp are imported inside those functions: the batch core
(batch/core.py) imports this module and loads no event loop and no HTTP client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Iterator, Sequence

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PHASE = "decode"
FAMILIES = {  # DecodeCounters field -> the plugin's counter family (its samples are `<family>_total`)
    "batch_before": "cohort_moe_batch_expert_loads_before",
    "batch_after": "cohort_moe_batch_expert_loads_after",
    "batch_layer_steps": "cohort_moe_batch_layer_forwards",
    "loads": "cohort_moe_expert_loads_after",
    "layer_forwards": "cohort_moe_layer_forwards",
    "tokens": "cohort_moe_routed_tokens",
}


class MetricsUnreadable(Exception):
    """A server's /metrics could not be read: the message names the URL and why."""


@dataclass(frozen=True)
class DecodeCounters:
    """The plugin's decode sums at one reading (or between two: `after - before`); see the module's table.
    Each derived figure is None where its denominator is not positive (nothing of that kind ran; a difference
    across a restart of the server can be negative)."""

    batch_before: float = 0.0
    batch_after: float = 0.0
    batch_layer_steps: float = 0.0
    loads: float = 0.0
    layer_forwards: float = 0.0
    tokens: float = 0.0

    def __add__(self, other: DecodeCounters) -> DecodeCounters:
        return DecodeCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: DecodeCounters) -> DecodeCounters:
        return DecodeCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def experts_per_layer_step(self) -> float | None:
        """Distinct experts loaded per MoE layer in a decode step of a whole batch."""
        return self.batch_after / self.batch_layer_steps if self.batch_layer_steps > 0 else None

    @property
    def policy_saving(self) -> float | None:
        """The share of the decode batches' expert loads the routing policy removed (0 under top-k)."""
        return 1 - self.batch_after / self.batch_before if self.batch_before > 0 else None

    @property
    def loads_per_token(self) -> float | None:
        """Decode expert loads per generated token."""
        return self.loads / self.tokens if self.tokens > 0 else None

    def tokens_per_forward(self, layers: int | None) -> float | None:
        """Decode tokens per forward, given the model's MoE layer count; None without it."""
        return self.tokens * layers / self.layer_forwards if layers and self.layer_forwards > 0 else None


def _plugin_families(text: str) -> Iterator:
    """The plugin's metric families in Prometheus text. Only the lines naming one of FAMILIES are parsed:
    vLLM's /metrics is mostly histograms, whose parsing would cost a reader (a batch run's event loop)
    more than the rest of its work per request."""
    ours = "\n".join(line for line in text.splitlines() if any(name in line for name in FAMILIES.values()))
    return text_string_to_metric_families(ours)


def parse_counters(text: str) -> DecodeCounters:
    """The decode sums in Prometheus text; zeros while the plugin has counted nothing (or is absent)."""
    fields_of = {name: key for key, name in FAMILIES.items()}
    sums = dict.fromkeys(FAMILIES, 0.0)
    for family in _plugin_families(text):
        key = fields_of.get(family.name)
        if key is not None:
            sums[key] += sum(s.value for s in family.samples
                             if s.name == family.name + "_total" and s.labels.get("phase") == PHASE)
    return DecodeCounters(**sums)


def has_plugin_counters(text: str) -> bool:
    """Whether Prometheus text carries every family of FAMILIES (the plugin's collector shows them even
    before its first sample)."""
    found = {family.name for family in _plugin_families(text)}
    return all(name in found for name in FAMILIES.values())


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`, in Prometheus text (all of it is
    parsed: any metric); 0 when none."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


async def fetch_counters(replicas: Sequence) -> DecodeCounters | None:
    """The counters summed over `replicas` (send.backend_client.BackendClient each: GET /metrics, all at
    once, parsed on a thread, off the loop that feeds the engine); None when one cannot be read."""
    import asyncio

    from moe_cohort.send.errors import ServiceError

    async def one(client) -> DecodeCounters | None:
        try:
            text = (await client.request("GET", "/metrics")).text
            return await asyncio.to_thread(parse_counters, text)
        except (ServiceError, ValueError) as exc:
            log.debug("no decode counters from %s: %s", client.base_url, exc)
            return None

    readings = await asyncio.gather(*(one(c) for c in replicas))
    return None if not readings or None in readings else sum(readings, DecodeCounters())


def read_metrics(url: str, timeout_s: float = 30.0) -> str:
    """The Prometheus text the server at `url` (its root, no /metrics) serves at /metrics, read now in an
    event loop of its own (not from inside a running one). Raises MetricsUnreadable when the server cannot be
    reached, does not answer within `timeout_s`, or answers 4xx/5xx."""
    import asyncio

    import aiohttp

    where = url.rstrip("/") + "/metrics"

    async def get() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(where) as response:
                return response.status, await response.read()

    try:
        status, content = asyncio.run(get())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:  # aiohttp's timeouts are TimeoutErrors
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise MetricsUnreadable(f"cannot read {where} ({why})") from exc
    if status >= 400:
        raise MetricsUnreadable(f"cannot read {where} (it answered {status})")
    return content.decode("utf-8", errors="replace")


def read_counters(url: str, timeout_s: float = 30.0) -> DecodeCounters:
    """The counters of the server at `url`, read now (`read_metrics`: raises MetricsUnreadable)."""
    return parse_counters(read_metrics(url, timeout_s))
