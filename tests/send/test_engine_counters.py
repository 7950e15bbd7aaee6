"""send/engine_counters.py: the plugin's decode counters, from Prometheus text written here by hand as vLLM's
/metrics serves it (a counter family `x` shows as `x_total`, prometheus_client adds `x_created`), and read over
HTTP from throwaway servers."""

import asyncio

import pytest
from aiohttp import web

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.engine.metrics import COUNTERS
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.engine_counters import (FAMILIES, DecodeCounters, MetricsUnreadable, fetch_counters,
                                             has_plugin_counters, metric_sum, parse_counters, read_counters)
from tests.helpers.vllm_stub import local_backend

# decode sums, by hand: batch_before 40+60, batch_after 40+30, batch_layer_steps 10+10, loads 48+24,
# layer_forwards 16+8, tokens 12+6; every other phase, family or metric must not count
SERVED = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{model_name="tiny"} 1.25
# HELP cohort_moe_batch_expert_loads_before_total Distinct experts of the whole batch under top-k
# TYPE cohort_moe_batch_expert_loads_before_total counter
cohort_moe_batch_expert_loads_before_total{phase="decode",policy="topk"} 40.0
cohort_moe_batch_expert_loads_before_total{phase="decode",policy="lynx-lat;drop=2"} 60.0
cohort_moe_batch_expert_loads_before_total{phase="prefill",policy="topk"} 900.0
cohort_moe_batch_expert_loads_before_total{phase="mixed",policy="mixed"} 500.0
# HELP cohort_moe_batch_expert_loads_before_created Distinct experts of the whole batch under top-k
# TYPE cohort_moe_batch_expert_loads_before_created gauge
cohort_moe_batch_expert_loads_before_created{phase="decode",policy="topk"} 1.7e+09
# HELP cohort_moe_batch_expert_loads_after_total Distinct experts of the whole batch after the policies
# TYPE cohort_moe_batch_expert_loads_after_total counter
cohort_moe_batch_expert_loads_after_total{phase="decode",policy="topk"} 40.0
cohort_moe_batch_expert_loads_after_total{phase="decode",policy="lynx-lat;drop=2"} 30.0
cohort_moe_batch_expert_loads_after_total{phase="prefill",policy="topk"} 800.0
# HELP cohort_moe_batch_layer_forwards_total (forward, MoE layer) pairs of whole batches
# TYPE cohort_moe_batch_layer_forwards_total counter
cohort_moe_batch_layer_forwards_total{phase="decode",policy="topk"} 10.0
cohort_moe_batch_layer_forwards_total{phase="decode",policy="lynx-lat;drop=2"} 10.0
cohort_moe_batch_layer_forwards_total{phase="prefill",policy="topk"} 5.0
# HELP cohort_moe_expert_loads_before_total Distinct experts chosen by the router (top-k)
# TYPE cohort_moe_expert_loads_before_total counter
cohort_moe_expert_loads_before_total{phase="decode",policy="topk"} 9999.0
# HELP cohort_moe_expert_loads_after_total Distinct experts used after the routing policy
# TYPE cohort_moe_expert_loads_after_total counter
cohort_moe_expert_loads_after_total{phase="decode",policy="topk"} 48.0
cohort_moe_expert_loads_after_total{phase="decode",policy="lynx-lat;drop=2"} 24.0
cohort_moe_expert_loads_after_total{phase="prefill",policy="topk"} 1000.0
# HELP cohort_moe_layer_forwards_total (forward, MoE layer) pairs with tokens of this phase and policy
# TYPE cohort_moe_layer_forwards_total counter
cohort_moe_layer_forwards_total{phase="decode",policy="topk"} 16.0
cohort_moe_layer_forwards_total{phase="decode",policy="lynx-lat;drop=2"} 8.0
cohort_moe_layer_forwards_total{phase="prefill",policy="topk"} 4.0
# HELP cohort_moe_routed_tokens_total Tokens routed, counted once per forward
# TYPE cohort_moe_routed_tokens_total counter
cohort_moe_routed_tokens_total{phase="decode",policy="topk"} 12.0
cohort_moe_routed_tokens_total{phase="decode",policy="lynx-lat;drop=2"} 6.0
cohort_moe_routed_tokens_total{phase="prefill",policy="topk"} 300.0
# HELP cohort_moe_distinct_experts_after Distinct experts per forward and MoE layer after the routing policy
# TYPE cohort_moe_distinct_experts_after histogram
cohort_moe_distinct_experts_after_bucket{le="+Inf",phase="decode",policy="topk"} 16.0
cohort_moe_distinct_experts_after_count{phase="decode",policy="topk"} 16.0
cohort_moe_distinct_experts_after_sum{phase="decode",policy="topk"} 48.0
"""
SERVED_SUMS = DecodeCounters(batch_before=100, batch_after=70, batch_layer_steps=20, loads=72, layer_forwards=24,
                             tokens=18)

# the plugin's families announced, no sample yet (a server that decoded nothing); then one without the batch families
EMPTY_PLUGIN = "".join(f"# HELP {name}_total h\n# TYPE {name}_total counter\n" for name in FAMILIES.values())
NO_BATCH_FAMILIES = "".join(f"# HELP {name}_total h\n# TYPE {name}_total counter\n"
                            for name in FAMILIES.values() if "_batch_" not in name)


def test_the_decode_sums_add_every_policy_and_leave_other_phases_families_and_metrics_out():
    assert parse_counters(SERVED) == SERVED_SUMS
    assert parse_counters("") == DecodeCounters() == parse_counters(EMPTY_PLUGIN)


def test_only_the_plugin_lines_are_parsed():
    broken = 'vllm:cache_usage{model_name="tiny" 0.5\n'  # a line the parser rejects: never parsed
    assert parse_counters(broken + SERVED) == SERVED_SUMS
    assert has_plugin_counters(broken + SERVED)


def test_the_figures_of_a_reading_are_the_ratios_of_its_sums():
    assert SERVED_SUMS.experts_per_layer_step == 70 / 20 == 3.5
    assert SERVED_SUMS.policy_saving == pytest.approx(1 - 70 / 100)
    assert SERVED_SUMS.loads_per_token == 72 / 18 == 4.0
    assert SERVED_SUMS.tokens_per_forward(4) == 18 * 4 / 24 == 3.0
    assert SERVED_SUMS.tokens_per_forward(None) is None  # without the MoE layer count


def test_readings_add_and_their_difference_is_what_ran_between_them():
    before = DecodeCounters(batch_before=10, batch_after=8, batch_layer_steps=4, loads=9, layer_forwards=6, tokens=3)
    after = DecodeCounters(batch_before=30, batch_after=20, batch_layer_steps=8, loads=33, layer_forwards=14, tokens=9)
    ran = after - before
    assert ran == DecodeCounters(batch_before=20, batch_after=12, batch_layer_steps=4, loads=24, layer_forwards=8,
                                 tokens=6)
    assert (ran.experts_per_layer_step, ran.policy_saving, ran.loads_per_token, ran.tokens_per_forward(2)) == (
        12 / 4, 1 - 12 / 20, 24 / 6, 6 * 2 / 8)
    assert before + ran == after
    assert sum([before, after], DecodeCounters()) == DecodeCounters(40, 28, 12, 42, 20, 12)


def test_a_figure_is_none_when_nothing_of_its_kind_ran():
    nothing = SERVED_SUMS - SERVED_SUMS
    assert nothing == DecodeCounters()
    assert nothing.experts_per_layer_step is None and nothing.policy_saving is None
    assert nothing.loads_per_token is None and nothing.tokens_per_forward(4) is None
    restarted = DecodeCounters(tokens=2, loads=5) - SERVED_SUMS  # counters reset by a restart: negative
    assert restarted.loads_per_token is None and restarted.experts_per_layer_step is None


def test_the_plugin_counters_are_seen_by_their_families_even_before_a_sample():
    assert has_plugin_counters(SERVED) and has_plugin_counters(EMPTY_PLUGIN)
    assert not has_plugin_counters(NO_BATCH_FAMILIES)
    assert not has_plugin_counters('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n')
    assert not has_plugin_counters("")


def test_the_families_read_are_the_ones_the_plugin_counts():
    assert set(FAMILIES.values()) <= COUNTERS.keys()


def test_metric_sum_adds_the_samples_whose_labels_include_the_given_ones():
    assert metric_sum(SERVED, "cohort_moe_routed_tokens_total", phase="decode") == 12 + 6
    assert metric_sum(SERVED, "cohort_moe_routed_tokens_total") == 12 + 6 + 300
    assert metric_sum(SERVED, "cohort_moe_routed_tokens_total", phase="decode", policy="topk") == 12
    assert metric_sum(SERVED, "cohort_moe_routed_tokens_total", phase="mixed") == 0
    assert metric_sum(SERVED, "vllm:num_requests_waiting") == 7
    assert metric_sum(SERVED, "vllm:time_to_first_token_seconds_count", model_name="tiny") == 4
    assert metric_sum(SERVED, "cohort_not_there_total") == 0
    assert metric_sum("", "cohort_moe_routed_tokens_total") == 0


def _serving(metrics: str | None):
    """A server whose /metrics answers `metrics` (None: 500)."""
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/metrics":
            return web.Response(status=404)
        if metrics is None:
            return web.Response(status=500, text="boom")
        return web.Response(text=metrics, content_type="text/plain")
    return handler


ONE_DECODE = """\
# TYPE cohort_moe_batch_expert_loads_before_total counter
cohort_moe_batch_expert_loads_before_total{phase="decode",policy="topk"} 5.0
# TYPE cohort_moe_routed_tokens_total counter
cohort_moe_routed_tokens_total{phase="decode",policy="topk"} 2.0
"""


def test_fetch_counters_sums_the_replicas_and_is_none_when_one_cannot_be_read():
    async def fetch(*texts):
        async with local_backend(_serving(texts[0])) as a, local_backend(_serving(texts[1])) as b:
            clients = [BackendClient(a, timeout_s=5), BackendClient(b, timeout_s=5)]
            try:
                return await fetch_counters(clients)
            finally:
                for c in clients:
                    await c.close()

    assert asyncio.run(fetch(SERVED, ONE_DECODE)) == SERVED_SUMS + DecodeCounters(batch_before=5, tokens=2)
    assert asyncio.run(fetch(SERVED, None)) is None
    assert asyncio.run(fetch_counters([])) is None


def test_read_counters_reads_one_server_and_names_the_url_when_it_cannot():
    async def read(metrics):
        async with local_backend(_serving(metrics)) as url:
            try:
                return await asyncio.to_thread(read_counters, url + "/")  # a sync caller, outside the loop
            except MetricsUnreadable as exc:
                return str(exc).replace(url, "URL")

    assert asyncio.run(read(ONE_DECODE)) == DecodeCounters(batch_before=5, tokens=2)
    assert asyncio.run(read(None)) == "cannot read URL/metrics (it answered 500)"
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MetricsUnreadable, match=f"cannot read {closed}/metrics \\(ClientConnectorError"):
        read_counters(closed, timeout_s=5)

