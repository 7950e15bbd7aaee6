"""`cohort serve --backend URL` and nothing else, in front of real vLLM CPU servers with the plugin: the proxy
configures itself from each engine's handshake (proxy/autoconfig.py) and learns from the model it serves."""

import time

import openai

from moe_cohort.proxy.autoconfig import TURN_ON_SCHEDULER
from moe_cohort.proxy.settings import Settings
from moe_cohort.proxy.vllm_server import free_port, start
from tests.proxy.servers import ProxyThread

SCHEDULER = ["--scheduler-cls", "moe_cohort.engine.scheduler.ExpertAwareScheduler"]


def _ask(proxy: ProxyThread, n: int) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
    for i in range(n):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"question {i}: why?"}],
                                       max_tokens=4)


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s  # a guard against hanging, not a timing
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.2)


def test_in_front_of_vllm_with_our_scheduler_it_forwards_profiles_and_learns(tiny_moe_dir, tmp_path):
    with start(tiny_moe_dir, max_num_seqs=4, extra_args=SCHEDULER) as server:
        settings = Settings(backend_url=server.url, port=free_port(), data_dir=str(tmp_path))  # no other setting
        with ProxyThread(settings) as proxy:
            state = proxy.server.config.app.state.proxy
            plan = state.plans[0]
            assert plan.engine_side and plan.slots == 256 and state.gate.profile_first
            assert state.learning.on and state.predictor.mode().startswith("first come, first served")
            _ask(proxy, 24)
            _until(lambda: state.learning.learner.head is not None)  # 16 observed: the first learned head
            assert state.predictor.mode() == "learned head"


def test_in_front_of_vllm_with_its_own_scheduler_it_admits_itself_on_its_slots(vllm_server, tmp_path):
    settings = Settings(backend_url=vllm_server.url, port=free_port(), data_dir=str(tmp_path))
    with ProxyThread(settings) as proxy:
        state = proxy.server.config.app.state.proxy
        plan = state.plans[0]
        assert (plan.engine_side, plan.slots, plan.could) == (False, 16, TURN_ON_SCHEDULER)  # its max_num_seqs
        assert state.learning.on  # the fixture's vLLM names the endpoint plugin: it serves the counts
        _ask(proxy, 2)
