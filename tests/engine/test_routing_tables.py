"""Table mode of the RoutingHook: the graph-safe path vLLM may capture in CUDA graphs.

Checked against eager mode (select_experts_mixed on the re-routed rows, tested in
test_routing_hook.py): same decisions, same metrics and recordings. Graph safety: the hook's
routing compiled once with torch.compile(fullgraph=True) follows new steps' policies without
recompiling; on a GPU, a CUDA graph captured once replays new steps' decisions with no host sync.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from moe_cohort.engine.engine_state import RequestOptions, build_step
from moe_cohort.engine.metrics import ExpertLoadMetrics
from moe_cohort.engine.policy import TopK, parse_policy
from moe_cohort.engine.routing_hook import HookConfig, LayerInfo, RoutingHook
from moe_cohort.engine.selection import select_topk
from moe_cohort.engine.selection.step_tables import StepTables, capture_error

E, K, LAYERS = 16, 4, 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _hook(tables: bool, **config) -> RoutingHook:
    hook = RoutingHook(HookConfig(graph_tables=tables, max_tokens=32, **config), ExpertLoadMetrics())
    for layer in range(LAYERS):
        hook.layers[layer] = LayerInfo(top_k=K, num_experts=E)
    return hook


def _router(num_rows, seed, device=DEVICE):
    logits = (torch.randn(num_rows, E, generator=torch.Generator().manual_seed(seed)) * 3).to(device)
    weights, ids = select_topk(logits, K)
    return logits, weights, ids.to(torch.int32)


def _step(texts, positions=None, prompts=None):
    """One row per request (decode), unless positions/prompts make some prefill."""
    n = len(texts)
    opts = [RequestOptions(parse_policy(t), False) for t in texts]
    return build_step([f"r{i}" for i in range(n)], list(range(n + 1)), positions or [9] * n, prompts or [3] * n, opts)


STEPS = [
    _step(["lynx-lat;drop=6", "topk", "xshare;m=4;k0=1", "lynx-lat;drop=6", "xshare;m=4;k0=1", "topk"]),
    _step(["xshare;m=2;k0=0"] * 3 + ["oea;k0=1", "moe-spec;budget=3", "oea;k0=1"]),
    _step(["oea;k0=1", "lynx-lat;drop=6", "topk", "topk", "moe-spec;budget=3", "topk"],
          positions=[0, 9, 9, 9, 9, 9], prompts=[3] * 6),  # row 0 is prefill: oea (decode-only) keeps top-k
]


@pytest.mark.parametrize("step", STEPS)
def test_table_mode_decides_like_eager_mode(step):
    eager, tables = _hook(False), _hook(True)
    logits, weights, ids = _router(8, seed=1)   # 6 rows of requests, 2 padding rows
    eager.begin_step(step)
    tables.begin_step(step)
    want_w, want_ids = eager.route(0, logits, weights, ids)
    got_w, got_ids = tables.route(0, logits, weights, ids)
    assert got_ids.dtype == ids.dtype and got_w.dtype == weights.dtype
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_table_mode_metrics_match_eager_mode():
    hooks = [_hook(False), _hook(True)]
    for hook in hooks:
        hook.begin_step(STEPS[0])
        for layer in range(LAYERS):
            hook.route(layer, *_router(6, seed=10 + layer))
        hook.end_step()
    names = ["cohort_moe_expert_loads_before_total", "cohort_moe_expert_loads_after_total"]
    for phase, policy in STEPS[0].groups:
        values = [[h.metrics.value(n, phase, policy) for n in names] for h in hooks]
        assert values[0] == values[1], (phase, policy)
    assert hooks[1].metrics.value(names[1], "decode", "lynx-lat;drop=6") < \
        hooks[1].metrics.value(names[0], "decode", "lynx-lat;drop=6")


def test_compiled_routing_follows_new_steps_without_recompiling():
    """The CPU path (the torch twin); on CUDA vLLM calls the hook inside its opaque custom op."""
    hook, eager = _hook(True), _hook(False)
    hook.use_tables(torch.device("cpu"))
    counter = CompileCounterWithBackend("aot_eager")
    route = torch.compile(lambda logits, w, i: hook.route(0, logits, w, i), fullgraph=True, backend=counter)
    logits, weights, ids = _router(8, seed=2, device="cpu")
    results = []
    for step in STEPS:
        hook.begin_step(step)     # writes the tables: new numbers in the same tensors
        eager.begin_step(step)
        got_w, got_ids = route(logits, weights, ids)
        want_w, want_ids = eager.route(0, logits, weights, ids)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w)
        results.append(got_ids.clone())
    assert counter.frame_count == 1          # compiled once: the steps changed data, not code
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_new_steps_without_host_sync():
    hook, eager = _hook(True), _hook(False)
    hook.use_tables(DEVICE)
    logits, weights, ids = _router(8, seed=3)
    hook.begin_step(STEPS[0])
    hook.route(0, logits, weights, ids)      # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_w, out_ids = hook.route(0, logits, weights, ids)
    for step in STEPS:
        torch.cuda.set_sync_debug_mode("error")
        try:
            hook.begin_step(step)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager.begin_step(step)
        want_w, want_ids = eager.route(0, logits, weights, ids)
        assert torch.equal(out_ids, want_ids), step
        torch.testing.assert_close(out_w, want_w)


def test_policies_beyond_the_slots_run_topk_and_are_reported():
    tables = StepTables(max_tokens=8, num_layers=1, num_experts=E, top_k=K, device=torch.device("cpu"), max_slots=3)
    spans = [(i, i + 1, parse_policy(f"xshare;m={i + 1}")) for i in range(4)]
    overflow = tables.write(spans, 4)
    assert overflow == [parse_policy("xshare;m=3"), parse_policy("xshare;m=4")]
    assert tables.device["pid"][:4].tolist() == [1, 2, 0, 0]


def test_capture_errors_name_the_setting_that_fixes_them():
    assert "COHORT_GRAPH_XSHARE_SPEC=1" in capture_error(parse_policy("xshare-spec;m=4"), 8, requests=False)
    assert capture_error(parse_policy("xshare-spec;m=4"), 8, requests=True) is None
    assert "COHORT_GRAPH_RANK_WIDTH >= 12" in capture_error(parse_policy("oea;k0=1;max_p=12"), 8, False)
    assert capture_error(parse_policy("oea;k0=1;max_p=8"), 8, False) is None
    assert capture_error(TopK(), 8, False) is None


def test_table_mode_records_what_the_engine_used(tmp_path):
    from moe_cohort.traces.importers import load_traces

    hook = RoutingHook(HookConfig(graph_tables=True, max_tokens=32, trace_dir=tmp_path), None)
    for layer in range(LAYERS):
        hook.layers[layer] = LayerInfo(top_k=K, num_experts=E)
    xshare, used = parse_policy("xshare;m=4;k0=1"), {}
    for index, (qsl, pos) in enumerate([([0, 3], 0), ([0, 1], 3)]):    # prefill, then a decode step
        hook.begin_step(build_step(["d"], qsl, [pos], [3], [RequestOptions(xshare, True)]))
        for layer in range(LAYERS):
            used[index, layer] = hook.route(layer, *_router(qsl[1], seed=100 * index + layer))
        hook.end_step()
    ts = load_traces(hook.finish_request("d", [7, 8, 9], [10, 11]))
    want_ids = torch.cat([torch.stack([used[i, layer][1] for layer in range(LAYERS)], 1) for i in range(2)])
    want_w = torch.cat([torch.stack([used[i, layer][0] for layer in range(LAYERS)], 1) for i in range(2)])
    assert torch.equal(torch.from_numpy(ts.experts.astype("int64")), want_ids.long().cpu())
    torch.testing.assert_close(torch.from_numpy(ts.weights), want_w.cpu())
