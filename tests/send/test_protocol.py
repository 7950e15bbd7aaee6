import json

import pytest

from moe_cohort.send.errors import InvalidRequest, PayloadTooLarge
from moe_cohort.send.protocol import check_size, parse_request
from tests.helpers.proxy_client import post, run
from tests.helpers.vllm_stub import OK_BODY, answer, body_of


def parse(body, route="chat", headers=None, default="topk", max_bytes=10_000):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, route, headers or {}, default_policy=default, max_bytes=max_bytes)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_unknown_fields_pass_through_and_policy_is_attached():
    req = parse({**CHAT, "top_k": 3, "my_field": {"x": 1}, "vllm_xargs": {"other": 1}},
                headers={"x-moe-routing": "oea;k0=2"})
    assert req.body["top_k"] == 3 and req.body["my_field"] == {"x": 1}
    assert req.body["vllm_xargs"] == {"other": 1, "moe_routing": req.policy}
    assert req.policy.startswith("oea") and "k0=2" in req.policy and not req.stream


def test_policy_from_body_then_default():
    assert parse({**CHAT, "vllm_xargs": {"moe_routing": "lynx-lat;drop=2"}}).policy.startswith("lynx-lat")
    assert parse(CHAT, default="xshare;m=4").policy.startswith("xshare")
    assert parse(CHAT).policy == "topk"


@pytest.mark.parametrize("body, route, message", [
    (b"{nope", "chat", "not valid JSON"),
    (b"[1, 2]", "chat", "must be a JSON object, got list"),
    ({"model": "m"}, "chat", "'messages' must be a non-empty list"),
    ({"model": "m", "messages": []}, "chat", "'messages' must be a non-empty list"),
    ({"model": "m", "prompt": 5}, "completion", "'prompt' must be a string"),
    ({**CHAT, "stream": "yes"}, "chat", "'stream' must be true or false"),
    ({**CHAT, "vllm_xargs": [1]}, "chat", "'vllm_xargs' must be an object"),
])
def test_bad_bodies_are_400_with_the_reason(body, route, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        parse(body, route)
    assert info.value.status_code == 400 and info.value.body()["error"]["type"] == "invalid_request_error"


def test_bad_policy_names_what_is_allowed():
    with pytest.raises(InvalidRequest, match="invalid routing policy 'bogus'.*allowed names: .*xshare") as info:
        parse(CHAT, headers={"x-moe-routing": "bogus"})
    assert info.value.body()["error"]["code"] == "invalid_policy"


@pytest.mark.parametrize("body, headers, message", [
    ({**CHAT, "vllm_xargs": {"moe_routing": ["xshare"]}}, {}, r"vllm_xargs.moe_routing must be a string .* got list"),
    ({**CHAT, "vllm_xargs": {"moe_routing": 3}}, {}, r"vllm_xargs.moe_routing must be a string .* got int 3"),
    ({**CHAT, "vllm_xargs": {"moe_routing": "bogus"}}, {}, r"'bogus' \(vllm_xargs.moe_routing\)"),
    (CHAT, {"x-moe-routing": "bogus"}, r"'bogus' \(X-MoE-Routing\)"),
])
def test_a_bad_policy_names_where_it_came_from(body, headers, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        parse(body, headers=headers)
    assert info.value.status_code == 400 and info.value.body()["error"]["code"] == "invalid_policy"


def test_completion_prompts_of_every_openai_shape():
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse({"model": "m", "prompt": prompt}, "completion").body["prompt"] == prompt


def test_size_limit_is_413():
    with pytest.raises(PayloadTooLarge, match="over the proxy's limit of 100 bytes"):
        parse({**CHAT, "pad": "x" * 200}, max_bytes=100)
    with pytest.raises(PayloadTooLarge):
        check_size("5000", 100)
    check_size(None, 100)


def test_policy_reaches_the_backend_as_vllm_xargs():
    bodies = []

    async def backend(request):
        bodies.append(await body_of(request))
        return answer(OK_BODY)

    resp = run(post(backend, {**CHAT, "custom": 1}, headers={"X-MoE-Routing": "lynx-lat;drop=2"}))
    assert resp.status_code == 200 and resp.headers["x-cohort-admission"].startswith("a")
    assert bodies[0]["vllm_xargs"]["moe_routing"].startswith("lynx-lat") and bodies[0]["custom"] == 1
