"""RoutingHook: per-request policies on their own rows, metrics and recording (no vLLM needed).

References are computed independently: `select_experts_mixed` on the hand-built sub-batch of
policy rows, and distinct-expert counts by Python sets.
"""

import logging

import numpy as np
import pytest
import torch

from moe_cohort.engine.engine_state import RequestOptions, build_step
from moe_cohort.engine.metrics import ExpertLoadMetrics
from moe_cohort.engine.policy import TopK, parse_policy
from moe_cohort.engine.routing_hook import HookConfig, LayerInfo, RoutingHook
from moe_cohort.engine.selection import select_experts_mixed, select_topk
from moe_cohort.traces.importers import load_traces

E, K, LAYERS = 16, 4, 3
LYNX = parse_policy("lynx-lat;drop=6")  # decode only
XSHARE = parse_policy("xshare;m=4;k0=1")  # prefill too


def _hook(tmp_path=None, **config):
    hook = RoutingHook(HookConfig(trace_dir=tmp_path or "unused", **config), ExpertLoadMetrics())
    for layer in range(LAYERS):
        hook.layers[layer] = LayerInfo(top_k=K, num_experts=E)
    return hook


def _router(num_rows, seed):
    """logits [T, E] and the router's (weights, ids), int32 ids like vLLM's CPU router."""
    logits = torch.randn(num_rows, E, generator=torch.Generator().manual_seed(seed)) * 3
    weights, ids = select_topk(logits, K)
    return logits, weights, ids.to(torch.int32)


def _mixed_step(record=False):
    # rows: a prefill(0..5, LYNX) | b decode(5, LYNX) | c decode(6, topk) | d decode(7, XSHARE) | e decode(8, LYNX)
    opts = [RequestOptions(LYNX, record), RequestOptions(LYNX, record), RequestOptions(TopK(), record),
            RequestOptions(XSHARE, record), RequestOptions(LYNX, record)]
    return build_step(["a", "b", "c", "d", "e"], [0, 5, 6, 7, 8, 9], positions=[0, 10, 7, 3, 20],
                      num_prompt_tokens=[9, 10, 7, 3, 9], options=opts)


def _distinct(ids, rows):
    return len({e for r in rows for e in ids[r].tolist()})


def test_policies_apply_to_their_own_rows_only():
    hook, step = _hook(), _mixed_step()
    hook.begin_step(step)
    logits, weights, ids = _router(11, seed=0)  # 2 padded rows at the end
    new_w, new_ids = hook.route(0, logits, weights, ids)
    assert new_ids.dtype == ids.dtype and new_w.dtype == weights.dtype
    untouched = [0, 1, 2, 3, 4, 6, 9, 10]  # LYNX prefill (decode-only policy), topk decode, padding
    assert torch.equal(new_ids[untouched], ids[untouched]) and torch.equal(new_w[untouched], weights[untouched])
    # rows 5, 8 (LYNX decode) and 7 (XSHARE) form the policy sub-batch, in row order
    rows = [5, 7, 8]
    ref_w, ref_ids = select_experts_mixed(logits[rows], K, [LYNX, XSHARE, LYNX], [(0, 1), (1, 2), (2, 3)])
    assert torch.equal(new_ids[rows].long(), ref_ids)
    torch.testing.assert_close(new_w[rows], ref_w)
    assert not torch.equal(new_ids[rows], ids[rows])  # the policies changed something


def test_all_topk_step_returns_the_router_output_itself():
    hook = _hook()
    hook.begin_step(build_step(["a", "b"], [0, 3, 4], [0, 9], [3, 9], [RequestOptions(TopK(), False)] * 2))
    logits, weights, ids = _router(4, seed=1)
    assert hook.route(0, logits, weights, ids) == (weights, ids)


def test_no_step_or_unknown_layer_passes_through():
    hook = _hook()
    logits, weights, ids = _router(4, seed=2)
    assert hook.route(0, logits, weights, ids) == (weights, ids)  # no step published (dummy run)
    hook.begin_step(_mixed_step())
    logits, weights, ids = _router(9, seed=2)
    assert hook.route(99, logits, weights, ids) == (weights, ids)  # not a known MoE layer


def test_layer_that_cannot_be_rerouted_keeps_topk_with_one_warning(caplog):
    hook = _hook()
    hook.layers[0] = LayerInfo(top_k=K, num_experts=E, supports_policies=False)
    hook.begin_step(_mixed_step())
    logits, weights, ids = _router(9, seed=3)
    with caplog.at_level(logging.WARNING):
        new_w, new_ids = hook.route(0, logits, weights, ids)
        hook.route(0, logits, weights, ids)
    assert torch.equal(new_ids, ids) and caplog.text.count("cannot be re-routed") == 1


def test_metrics_count_distinct_experts_per_group_and_batch():
    hook, step = _hook(), _mixed_step()
    hook.begin_step(step)
    before, after = [], []
    for layer in range(LAYERS):
        logits, weights, ids = _router(9, seed=10 + layer)
        _, new_ids = hook.route(layer, logits, weights, ids)
        before.append(ids)
        after.append(new_ids)
    hook.end_step()
    groups = {("prefill", "lynx-lat;drop=6"): [0, 1, 2, 3, 4], ("decode", "lynx-lat;drop=6"): [5, 8],
              ("decode", "topk"): [6], ("decode", "xshare;m=4;k0=1"): [7]}
    assert set(groups) == set(step.groups)
    m = hook.metrics
    for (phase, policy), rows in groups.items():
        assert m.value("cohort_moe_expert_loads_before_total", phase, policy) == sum(_distinct(b, rows) for b in before)
        assert m.value("cohort_moe_expert_loads_after_total", phase, policy) == sum(_distinct(a, rows) for a in after)
        assert m.value("cohort_moe_layer_forwards_total", phase, policy) == LAYERS
        assert m.value("cohort_moe_routed_tokens_total", phase, policy) == len(rows)
    all_rows = list(range(9))
    assert m.value("cohort_moe_batch_expert_loads_before_total", "mixed", "mixed") == sum(
        _distinct(b, all_rows) for b in before)
    assert m.value("cohort_moe_batch_expert_loads_after_total", "mixed", "mixed") == sum(
        _distinct(a, all_rows) for a in after)
    # topk rows are untouched: equal before and after; the drop policy loads fewer experts
    assert (m.value("cohort_moe_expert_loads_after_total", "decode", "topk")
            == m.value("cohort_moe_expert_loads_before_total", "decode", "topk"))
    assert (m.value("cohort_moe_expert_loads_after_total", "decode", "lynx-lat;drop=6")
            < m.value("cohort_moe_expert_loads_before_total", "decode", "lynx-lat;drop=6"))


def test_recording_writes_what_the_engine_used(tmp_path):
    hook = _hook(tmp_path)
    hook.decode_text = lambda ids: f"{len(ids)} tokens"
    used = {}
    # prefill step of request "d" (3 prompt tokens) then two decode steps
    for index, (qsl, pos) in enumerate([([0, 3], 0), ([0, 1], 3), ([0, 1], 4)]):
        hook.begin_step(build_step(["d"], qsl, [pos], [3], [RequestOptions(XSHARE, True)]))
        for layer in range(LAYERS):
            logits, weights, ids = _router(qsl[1], seed=100 * index + layer)
            new_w, new_ids = hook.route(layer, logits, weights, ids)
            used[(index, layer)] = (new_w, new_ids)
        hook.end_step()
    path = hook.finish_request("d", [7, 8, 9], [10, 11, 12])
    ts = load_traces(path)
    assert ts.num_tokens.tolist() == [5] and ts.num_prompt_tokens.tolist() == [3] and ts.texts.tolist() == ["3 tokens"]
    expected_ids = torch.cat([torch.stack([used[(i, l)][1] for l in range(LAYERS)], 1) for i in range(3)])
    expected_w = torch.cat([torch.stack([used[(i, l)][0] for l in range(LAYERS)], 1) for i in range(3)])
    assert torch.equal(torch.from_numpy(ts.experts.astype("int64")), expected_ids.long())
    torch.testing.assert_close(torch.from_numpy(ts.weights), expected_w)
    assert ts.extra["policy"] == "xshare;m=4;k0=1"


def test_unrecorded_requests_write_nothing(tmp_path):
    hook = _hook(tmp_path)
    hook.begin_step(build_step(["x"], [0, 2], [0], [2], [RequestOptions(TopK(), False)]))
    hook.route(0, *_router(2, 0))
    hook.end_step()
    assert hook.finish_request("x", [1, 2], [3]) is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [{"moe_routing": "nope"}, {"moe_routing": "oea;k0=9"}, {"moe_record": "perhaps"}])
def test_bad_request_options_fall_back_to_the_default_with_a_warning(extra, caplog):
    hook = _hook(default_policy=XSHARE)
    with caplog.at_level(logging.WARNING):
        opts = hook.options_for("r1", extra)
    assert opts == RequestOptions(XSHARE, False)
    assert "request r1" in caplog.text and "using the default policy xshare;m=4;k0=1" in caplog.text


def test_options_are_cached_until_the_request_finishes():
    hook = _hook()
    assert hook.options_for("r", {"moe_routing": "oea;k0=2"}).policy == parse_policy("oea;k0=2")
    assert hook.options_for("r", None).policy == parse_policy("oea;k0=2")  # cached by request id
    hook.finish_request("r", [1], [])
    assert hook.options_for("r", None).policy == TopK()


def test_a_batch_of_one_policy_is_routed_by_the_selector_alone():
    hook = _hook()
    opts = [RequestOptions(XSHARE, False)] * 3
    hook.begin_step(build_step(["a", "b", "c"], [0, 1, 2, 3], [4, 4, 4], [3, 3, 3], opts))
    logits, weights, ids = _router(3, seed=7)
    new_w, new_ids = hook.route(0, logits, weights, ids)
    ref_w, ref_ids = select_experts_mixed(logits, K, [XSHARE] * 3, [(0, 1), (1, 2), (2, 3)])
    assert new_ids.dtype == torch.int32 and torch.equal(new_ids.long(), ref_ids)
    torch.testing.assert_close(new_w, ref_w)


def test_a_reused_step_routes_like_a_fresh_one():
    """The wiring reuses the Step of a steady decode batch; its cached plan must give the same routing."""
    hook, step = _hook(), _mixed_step()
    results = []
    for seed, current in [(1, step), (2, step), (2, _mixed_step())]:
        hook.begin_step(current)
        results.append(hook.route(0, *_router(9, seed=seed)))
        hook.end_step()
    assert torch.equal(results[1][1], results[2][1]) and torch.equal(results[1][0], results[2][0])
    assert not torch.equal(results[0][1], results[1][1])  # different logits, different routing


def test_the_engine_honours_a_requests_moe_record_only_where_the_operator_lets_requests_ask():
    """Issue 27: an engine reached without the API server's check (an offline LLM, another front end) still
    records a request that asks only under COHORT_RECORD_TRACES=request (or =1)."""
    asked = {"moe_routing": "oea;k0=2", "moe_record": True}
    assert _hook().options_for("r", asked) == RequestOptions(parse_policy("oea;k0=2"), False)  # kept its policy
    assert _hook(record_requests=True).options_for("r", asked).record is True
    assert _hook(record_all=True).options_for("r", {"moe_record": False}).record is False


def test_observed_requests_are_counted_after_their_policy_and_handed_over_once():
    from moe_cohort.traces.observed import Observed

    hook = _hook()
    used = []
    observed, plain = RequestOptions(XSHARE, False, "tok-1"), RequestOptions(TopK(), False)
    # a prefill of "o" (3 prompt tokens) beside a plain request, then two decode steps of both
    for index, (qsl, pos) in enumerate([([0, 3, 5], [0, 0]), ([0, 1, 2], [3, 2]), ([0, 1, 2], [4, 3])]):
        step = build_step(["o", "p"], qsl, pos, [3, 2], [observed, plain])
        assert step.observe and not step.steady
        hook.begin_step(step)
        for layer in range(LAYERS):
            _, new_ids = hook.route(layer, *_router(qsl[-1], seed=10 * index + layer))
            used.append((index, layer, new_ids[: qsl[1]].numpy().copy()))
        hook.end_step()
    assert hook.take_observed(["tok-1"]) == {}  # still running
    hook.finish_request("o", [1, 2, 3], [4, 5, 6])
    got = Observed.from_wire(hook.take_observed(["tok-1"])["tok-1"])
    want = np.zeros((2, LAYERS, E), np.int64)
    for index, layer, ids in used:
        for row, token_ids in enumerate(ids):
            want[0 if index == 0 else 1, layer, token_ids] += 1
    np.testing.assert_array_equal(got.prompt, want[0])
    np.testing.assert_array_equal(got.decode, want[1])
    assert (got.prompt_tokens, got.decode_tokens) == (3, 2)
    assert hook.take_observed(["tok-1"]) == {}


@pytest.mark.parametrize("route_prompts", [True, False])
def test_prompt_routing_for_the_decode_gate_covers_every_prompt_and_is_handed_over_once_its_prefill_ends(route_prompts):
    hook = _hook()
    hook.route_prompts = route_prompts
    plain = RequestOptions(TopK(), False)
    used = {"a": [], "b": []}
    # a: 4 prompt tokens in two chunks; b: 2 prompt tokens, then a decode beside a's last chunk
    for index, (ids, qsl, pos) in enumerate([(["a", "b"], [0, 2, 4], [0, 0]), (["a", "b"], [0, 2, 3], [2, 2])]):
        step = build_step(ids, qsl, pos, [4, 2], [plain, plain])
        assert step.prefilling
        hook.begin_step(step)
        for layer in range(LAYERS):
            _, new_ids = hook.route(layer, *_router(qsl[-1], seed=10 * index + layer))
            used["a"].append((layer, new_ids[0:2].numpy().copy()))
            if index == 0:
                used["b"].append((layer, new_ids[2:4].numpy().copy()))
        hook.end_step()
        if index == 0 and route_prompts:
            assert list(hook.take_prompt_routing()) == ["b"]
    got = hook.take_prompt_routing()
    if not route_prompts:
        assert got == {} and hook.prompts is None
        return
    assert list(got) == ["a"] and hook.take_prompt_routing() == {}
    want = np.zeros((LAYERS, E))
    for layer, ids in used["a"]:
        for row in ids:
            want[layer, row] += 1
    np.testing.assert_allclose(got["a"], want / 4)


def test_a_batch_with_nobody_observed_counts_nothing_and_stays_steady():
    hook = _hook()
    step = build_step(["p"], [0, 1], [5], [2], [RequestOptions(TopK(), False)])
    assert step.steady and not step.observe
    hook.begin_step(step)
    hook.route(0, *_router(1, 0))
    hook.end_step()
    assert hook.counts is None


def test_a_moe_observe_token_is_a_short_string():
    from moe_cohort.engine.engine_state import request_options

    assert request_options({"moe_observe": "p1-7"}).observe == "p1-7"
    for bad in (7, "", "x" * 129):
        with pytest.raises(ValueError, match="moe_observe must be a string"):
            request_options({"moe_observe": bad})
