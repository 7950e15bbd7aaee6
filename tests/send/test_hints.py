"""Engine hints (vllm_xargs) from clients: the keys the proxy owns are dropped unless the caller is trusted; the
operator limits the routing policies clients may ask for, on every generating route and in batch lines."""

from __future__ import annotations

import json
import time

import pytest

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import EchoBackend


FORGED = {"moe_profile": [1, 2, 3, 4, 5, 6, 7, 8], "moe_record": True, "moe_routing": "OEA; k0=1", "temperature_x": 3}


def _hints_proxy(backend, tmp_path, **settings):
    return ProxyThread(Settings(backends=(backend.url,), port=free_port(), encoder="none", data_dir=str(tmp_path),
                                **settings))


def _send_forged(proxy) -> list:
    """A chat completion (official client), a completion and a response (httpx), each with FORGED xargs."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"vllm_xargs": dict(FORGED)})
    answers = [httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi", "vllm_xargs": FORGED}),
               httpx.post(proxy.url + "/v1/responses", json={"model": "m", "input": "hi", "vllm_xargs": FORGED})]
    return answers


def test_the_proxy_drops_the_engine_hints_it_owns_from_clients(tmp_path):
    """A client's vllm_xargs {"moe_profile": [...], "moe_record": true} never reaches the backend, on any route
    that generates; the routing policy and other keys stay."""
    with EchoBackend() as backend, _hints_proxy(backend, tmp_path) as proxy:
        assert [a.status_code for a in _send_forged(proxy)] == [200, 200]
    assert [path for path, _ in backend.bodies] == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    for _, body in backend.bodies:
        assert body["vllm_xargs"] == {"moe_routing": "oea;k0=1", "temperature_x": 3}


def test_trusted_callers_may_pass_the_engine_hints(tmp_path):
    with EchoBackend() as backend, _hints_proxy(backend, tmp_path, trust_client_hints=True) as proxy:
        _send_forged(proxy)
    for _, body in backend.bodies:
        assert body["vllm_xargs"] == {**FORGED, "moe_routing": "oea;k0=1"}


def test_the_operator_limits_the_routing_policies_clients_may_ask_for(tmp_path):
    import httpx
    import openai

    with EchoBackend() as backend, _hints_proxy(backend, tmp_path, allowed_policies=("OEA", "xshare;m=8"),
                                                 default_policy="topk") as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)

        def chat(**kw):
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **kw)

        chat(extra_headers={"x-moe-routing": "oea;k0=2;max_p=4"})  # a listed name: any parameters
        chat(extra_body={"vllm_xargs": {"moe_routing": "xshare; m=8"}})  # a listed policy, written otherwise
        chat(extra_body={"vllm_xargs": {"moe_routing": "topk"}})  # the server's default: always allowed
        chat()
        for kw, source in [({"extra_headers": {"x-moe-routing": "xshare;m=16"}}, "X-MoE-Routing"),
                           ({"extra_body": {"vllm_xargs": {"moe_routing": "lynx-lat;drop=2"}}}, "vllm_xargs.moe_routing")]:
            with pytest.raises(openai.BadRequestError) as refused:
                chat(**kw)
            error = refused.value.response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "policy_not_allowed",
                                                                     source)
            assert "allowed: oea, xshare;m=8;k0=1 " in error["message"] and "'topk'" in error["message"]
        response = httpx.post(proxy.url + "/v1/responses", json={"model": "m", "input": "hi"},
                              headers={"x-moe-routing": "xshare;m=16"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "policy_not_allowed"
    assert [b["vllm_xargs"]["moe_routing"] for _, b in backend.bodies] == ["oea;k0=2;max_p=4", "xshare;m=8;k0=1", "topk",
                                                                           "topk"]


def test_batch_lines_follow_the_same_rules(tmp_path):
    """A Batch API batch: forged hints dropped from the lines sent; a policy off the list fails validation."""
    import openai

    def line(cid, xargs):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": xargs}})

    with EchoBackend() as backend, _hints_proxy(backend, tmp_path, allowed_policies=("oea",)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)

        def run(lines):
            upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 60
            while batch.status not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline, batch.status
                time.sleep(0.1)
                batch = client.batches.retrieve(batch.id)
            return batch

        assert run([line("a", FORGED)]).status == "completed"
        failed = run([line("b", {"moe_routing": "xshare;m=8"})])
    assert [b["vllm_xargs"] for _, b in backend.bodies] == [{"moe_routing": "oea;k0=1", "temperature_x": 3,
                                                              "moe_batch": 1}]  # the line's mark: no fairness bound
    assert failed.status == "failed" and failed.errors.data[0].line == 1
    assert "is not allowed on this proxy; allowed: oea" in failed.errors.data[0].message


@pytest.mark.parametrize("env, expected", [({"COHORT_ALLOWED_POLICIES": "topk, OEA,xshare; m=8"},
                                            ("topk", "oea", "xshare;m=8;k0=1")), ({}, ())])
def test_allowed_policies_setting(env, expected):
    from moe_cohort.send.setting_sources import load_settings

    assert load_settings(environ=env).allowed_policies == expected
    assert load_settings(environ={"COHORT_TRUST_CLIENT_HINTS": "1"}).trust_client_hints is True


def test_allowed_policies_from_the_config_file(tmp_path):
    """`cohort serve --config c.yaml --backend http://a --backend http://b`, the file listing the policies, parsed
    as cohort serve parses it."""
    import argparse

    from moe_cohort.cli import serve as cli
    from moe_cohort.cli.setting_flags import flag_overrides
    from moe_cohort.send.setting_sources import load_settings

    (tmp_path / "c.yaml").write_text("allowed_policies: [oea, 'xshare;m=8']\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--config", str(tmp_path / "c.yaml"), "--backend", "http://a", "--backend", "http://b"])
    settings = load_settings(flag_overrides(args, cli._FLAGS), environ={}, config=args.config)
    assert settings.allowed_policies == ("oea", "xshare;m=8;k0=1")
    assert settings.backends == ("http://a", "http://b")


def test_a_bad_allowed_policy_names_the_setting():
    from moe_cohort.send.setting_sources import load_settings
    from moe_cohort.send.settings import SettingsError

    with pytest.raises(SettingsError, match=r"allowed_policies \(env COHORT_ALLOWED_POLICIES\) must be policy names"):
        load_settings(environ={"COHORT_ALLOWED_POLICIES": "topk,bogus"})
