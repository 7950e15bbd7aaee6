"""Reading a server's /metrics: sums of Prometheus samples, and the plugin's decode counters.

The moe-cohort plugin counts, per forward pass, MoE layer and group of tokens (engine/metrics.py):

    loads      cohort_moe_expert_loads_after_total   distinct experts the group's tokens used, summed
                                                     over forwards and layers
    forwards   cohort_moe_layer_forwards_total       (forward, layer) pairs in which the group had tokens
    tokens     cohort_moe_routed_tokens_total        tokens of the group, counted once per forward

Summed over policies in the decode phase, the difference of two readings gives, over what the engine
ran between them, decode expert loads per GENERATED token (loads / tokens) and decode tokens per
forward (tokens * MoE layers / forwards). Compare policies per generated token, never per forward: one
that leaves slots empty touches fewer experts per forward and loses throughput. The counters are
server-wide: other traffic on the server counts too.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

DECODE = {"loads": "cohort_moe_expert_loads_after_total", "forwards": "cohort_moe_layer_forwards_total",
          "tokens": "cohort_moe_routed_tokens_total"}
PLUGIN_FAMILIES = ("cohort_moe_expert_loads_after", "cohort_moe_layer_forwards", "cohort_moe_routed_tokens")


def scrape(url: str, timeout: float = 30.0) -> str:
    """The Prometheus text a server at `url` (no /metrics) serves at /metrics; urllib's errors pass through."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        return resp.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`, in Prometheus text; 0 when none."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def decode_sums(text: str) -> dict[str, float]:
    """The decode-phase sums of the plugin's counters in Prometheus text: {"loads", "forwards", "tokens"}."""
    return {key: metric_sum(text, name, phase="decode") for key, name in DECODE.items()}


def decode_counters(url: str) -> dict[str, float]:
    """`decode_sums` of the server at `url`, read now."""
    return decode_sums(scrape(url))


def has_plugin_counters(text: str) -> bool:
    """Whether Prometheus text carries the plugin's counters (their families, even before any sample)."""
    names = {family.name for family in text_string_to_metric_families(text)}
    return all(name in names for name in PLUGIN_FAMILIES)


def decode_rates(before: dict[str, float], after: dict[str, float],
                 layers: int | None) -> tuple[float, float | None]:
    """(decode expert loads per generated token, decode tokens per forward) between two `decode_sums`;
    the second is None without the model's MoE layer count. NaN loads per token when no token was decoded."""
    d = {key: after[key] - before[key] for key in DECODE}
    per_token = d["loads"] / d["tokens"] if d["tokens"] > 0 else float("nan")
    per_forward = d["tokens"] * layers / d["forwards"] if layers and d["forwards"] > 0 else None
    return per_token, per_forward
