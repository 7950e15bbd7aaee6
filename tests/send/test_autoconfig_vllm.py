"""`cohort serve --backend URL` and nothing else, in front of real vLLM CPU servers with the plugin: the proxy
configures itself from each engine's handshake (send/autoconfig.py) and learns from the model it serves."""

import time

import openai

from moe_cohort.embedded.vllm_server import free_port, start
from moe_cohort.send.autoconfig import TURN_ON_SCHEDULER
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread

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


def test_in_front_of_vllm_with_its_own_scheduler_it_admits_itself_on_its_slots(vllm_server, tmp_path):
    settings = Settings(backends=(vllm_server.url,), port=free_port(), data_dir=str(tmp_path))
    with ProxyThread(settings) as proxy:
        state = proxy.server.config.app.state.proxy
        plan = state.plans[0]
        assert (plan.engine_side, plan.max_in_flight, plan.could) == (False, 16, TURN_ON_SCHEDULER)  # its max_num_seqs
        assert state.learning.on  # the fixture's vLLM names the endpoint plugin: it serves the counts
        _ask(proxy, 2)


def test_in_front_of_vllm_with_our_scheduler_behind_a_key_it_forwards_profiles_and_learns(tiny_moe_dir, tmp_path,
                                                                                          capsys):
    """In front of vLLM with our scheduler the proxy forwards at once with profiles and learns its first head. That
    vLLM is started with --api-key, which refuses /v1/... without it: the handshake, the expert counts and the
    requests all go with --backend-api-key, so the proxy and a batch run configure themselves and learn as without
    a key (the batch run does not probe: our scheduler routes each prompt in its own prefill). (One server for both: each vLLM start costs about a minute on 2 cores.)"""
    import json

    from moe_cohort.cli import main

    with start(tiny_moe_dir, max_num_seqs=4, extra_args=[*SCHEDULER, "--api-key", "backend-secret"]) as server:
        settings = Settings(backends=(server.url,), port=free_port(), data_dir=str(tmp_path / "serve"),
                            backend_api_key="backend-secret")
        with ProxyThread(settings) as proxy:
            state = proxy.server.config.app.state.proxy
            plan = state.plans[0]
            assert state.engines[0].expert_aware  # the handshake was answered
            assert plan.engine_side and plan.max_in_flight == 256 and state.gate.profile_first
            assert state.learning.on and state.predictor.mode().startswith("first come, first served")
            _ask(proxy, 20)
            _until(lambda: state.learning.learner.head is not None)  # 16 observed, their counts taken with the key
            assert state.predictor.mode() == "learned head"
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                           "body": {"model": "tiny", "max_tokens": 4, "messages": [
                                               {"role": "user", "content": f"question {i}"}]}}) + "\n"
                               for i in range(8)))
        code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--backend",
                     server.url, "--backend-api-key", "backend-secret", "--data-dir", str(tmp_path / "batch"),
                     "--learn", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and "72 at a time (4 for its max_num_seqs and a queue of 68)" in err and "learning on" in err, err
    assert "done: 8 succeeded" in err and "learned: 8 observed requests" in err
    assert "its scheduler prefills 64 ahead" in err and "no probe" in err and "probed" not in err
