"""moe_cohort.batch.probe_request: a probe's body, and the profile its prompt's counts give."""

import numpy as np

from moe_cohort.batch.probe_request import probe_body, prompt_profile
from moe_cohort.traces.observed import from_routed_experts
from tests.helpers.probe_routing import EXPERTS, LAYERS, PROMPT_TOKENS, routing_of


def test_a_probe_asks_one_token_of_the_same_prompt_under_the_same_policy():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "n": 3, "logprobs": True, "min_tokens": 8,
            "max_completion_tokens": 64, "vllm_xargs": {"moe_routing": "xshare;m=8"}, "temperature": 0.5}
    assert probe_body(body) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                "vllm_xargs": {"moe_routing": "xshare;m=8"}, "temperature": 0.5}
    assert body["max_tokens"] == 64 and body["stream"]  # the line's own body is left as it is


def test_a_prompt_profile_is_each_experts_share_of_the_prompt_tokens():
    counts = from_routed_experts(routing_of("chess", 3), PROMPT_TOKENS, EXPERTS)
    profile = prompt_profile(counts)  # [L, E]
    expected = np.zeros((LAYERS, EXPERTS))
    expected[:, [2, 3]] = 1.0  # every prompt token picked experts 2 and 3
    np.testing.assert_allclose(profile, expected)


def test_a_probe_of_vllm_sampling_parameters_keeps_what_routes_and_asks_one_token():
    params = {"max_tokens": 64, "ignore_eos": True, "n": 2, "min_tokens": 8, "guided_decoding": {"json": {}},
              "extra_args": {"moe_routing": "oea"}, "temperature": 0.0}
    assert probe_body(params) == {"max_tokens": 1, "ignore_eos": True, "extra_args": {"moe_routing": "oea"},
                                  "temperature": 0.0}
