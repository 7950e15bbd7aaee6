"""The plugin's live expert-load counters, read from the vLLM server's /metrics (see engine/metrics.py).

Decode forwards of whole batches only (`cohort_moe_batch_*{phase="decode"}`, summed over policies):
the memory-bound phase where the number of distinct experts a batch touches sets the cost.

    before / after   distinct experts per (forward, MoE layer) under top-k / after the routing policy, summed
    forwards         (forward, MoE layer) pairs

`per_forward` = after / forwards is the mean number of experts loaded per layer in a decode step
(what expert-coherent batching lowers); `policy_saving` = 1 - after / before is what the routing
policy removed on top. The counters are server-wide: other traffic on the same server is counted too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

FAMILIES = {"before": "cohort_moe_batch_expert_loads_before", "after": "cohort_moe_batch_expert_loads_after",
            "forwards": "cohort_moe_batch_layer_forwards"}


@dataclass(frozen=True)
class ExpertLoads:
    before: float = 0.0
    after: float = 0.0
    forwards: float = 0.0

    def __sub__(self, other: "ExpertLoads") -> "ExpertLoads":
        return ExpertLoads(self.before - other.before, self.after - other.after, self.forwards - other.forwards)

    def __add__(self, other: "ExpertLoads") -> "ExpertLoads":
        return ExpertLoads(self.before + other.before, self.after + other.after, self.forwards + other.forwards)

    @property
    def per_forward(self) -> float | None:
        return self.after / self.forwards if self.forwards else None

    @property
    def policy_saving(self) -> float | None:
        return 1 - self.after / self.before if self.before else None


def parse_expert_loads(text: str, phase: str = "decode") -> ExpertLoads:
    """The totals of `phase` in Prometheus text; zeros while the plugin has counted nothing (or is absent). Only
    the lines of FAMILIES are parsed: vLLM's /metrics is mostly histograms, whose parsing would cost a reader
    (a batch run's event loop) more than the rest of its work per request."""
    totals = {key: 0.0 for key in FAMILIES}
    names = {name: key for key, name in FAMILIES.items()}
    ours = "\n".join(line for line in text.splitlines() if any(name in line for name in names))
    for family in text_string_to_metric_families(ours):
        key = names.get(family.name)
        if key is not None:
            totals[key] += sum(s.value for s in family.samples
                               if s.name.endswith("_total") and s.labels.get("phase") == phase)
    return ExpertLoads(**totals)


async def fetch_expert_loads(replicas: Sequence) -> ExpertLoads | None:
    """The counters summed over `replicas` (send.backend_client.BackendClient each: GET /metrics, all at once);
    None when one cannot be read."""
    import asyncio  # here, so that the batch core (which reads ExpertLoads) loads no event loop

    from moe_cohort.send.errors import ProxyError

    async def one(client) -> ExpertLoads | None:
        try:
            text = (await client.request("GET", "/metrics")).text
            return await asyncio.to_thread(parse_expert_loads, text)  # off the loop that feeds the engine
        except (ProxyError, ValueError) as exc:
            log.debug("no expert-load metrics from %s: %s", client.base_url, exc)
            return None

    loads = await asyncio.gather(*(one(c) for c in replicas))
    return None if not loads or None in loads else sum(loads, ExpertLoads())
