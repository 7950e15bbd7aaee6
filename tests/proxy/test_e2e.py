"""The proxy end to end: a real vLLM CPU server on the tiny MoE, the proxy under uvicorn, the official client."""

import asyncio
import json
import re
import socket
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread

MESSAGES = [{"role": "user", "content": "Write a poem about the sea"}]
# one client for the metrics polls: each `httpx.get` builds an SSL context (OpenSSL reads the CA bundle, holding
# the GIL), which took seconds while vLLM's generation held both cores, so a poll outlasted the request it waited for
HTTP = httpx.Client(timeout=30, limits=httpx.Limits(keepalive_expiry=2))  # under the servers' 5 s keep-alive


@pytest.fixture(scope="module")
def proxy(vllm_server):
    settings = Settings(backends=(vllm_server.url,), port=free_port(), max_in_flight=16, encoder="none", keepalive_s=5)
    with ProxyThread(settings) as p:
        yield p


@pytest.fixture
def client(proxy):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completion_through_the_proxy(client, vllm_server):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    chat = raw.parse()
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    assert raw.headers["x-cohort-admission"].startswith("a") and float(raw.headers["x-cohort-queue-ms"]) >= 0
    direct = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused")
    same = direct.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert same.choices[0].message.content == chat.choices[0].message.content  # response comes back unchanged
    completion = client.completions.create(model="tiny", prompt="1 2 3", max_tokens=5, temperature=0)
    assert completion.choices[0].text is not None and completion.usage.completion_tokens <= 5


def test_unknown_fields_reach_vllm(client):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, logprobs=2,
                                    extra_body={"ignore_eos": True, "min_tokens": 3})
    assert out.usage.completion_tokens == 3 and len(out.choices[0].logprobs.top_logprobs[0]) >= 2


def test_streaming_matches_the_non_streaming_answer(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_concurrent_requests_each_get_their_own_admission(proxy):
    async def main():
        oa = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        calls = [oa.chat.completions.with_raw_response.create(model="tiny", max_tokens=4,
                                                              messages=[{"role": "user", "content": f"q{i}"}])
                 for i in range(4)]
        return await asyncio.gather(*calls)

    answers = asyncio.run(main())
    assert len({a.headers["x-cohort-admission"] for a in answers}) == 4 and all(a.parse().choices for a in answers)


def test_the_backend_accepts_a_forwarded_expert_profile(vllm_server):
    from moe_cohort.admission.wire import compact

    profile = compact(np.eye(4, 16))  # [L=4, E=16] what the proxy forwards for the engine-side scheduler
    answer = httpx.post(vllm_server.url + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "1 2 3", "max_tokens": 2, "vllm_xargs": {"moe_profile": profile}})
    assert answer.status_code == 200, answer.text


def test_models_are_relayed_from_the_backend(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_policy_header_reaches_the_engine(client, vllm_server):
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                   extra_headers={"X-MoE-Routing": "xshare;m=2;k0=1"},
                                   extra_body={"ignore_eos": True})
    text = httpx.get(vllm_server.url + "/metrics").text
    decode = re.search(r'cohort_moe_expert_loads_after_total\{phase="decode",policy="(xshare[^"]*)"\} ([0-9.e+]+)', text)
    assert decode, "the plugin saw no decode step under the header's policy"
    assert float(decode.group(2)) > 0


def _vllm_metric(server, name):
    text = HTTP.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


LONG = 4000  # tokens a request asks for: vLLM is still generating when the abort lands (max_model_len 4096)


def _generated_after(server, run_and_leave):
    """Run `run_and_leave()` (a client that starts a LONG request and leaves), wait until vLLM runs
    nothing, and return the tokens it generated meanwhile (LONG when it was not aborted)."""
    warm = {"model": "tiny", "prompt": "warm", "max_tokens": 4, "stream": True}
    HTTP.post(server.url + "/v1/completions", json=warm, timeout=60)  # a cold server streams its first request late
    tokens = _vllm_metric(server, "vllm:generation_tokens_total")
    run_and_leave()
    deadline = time.monotonic() + 60
    while _vllm_metric(server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the request is still running at vLLM"
        time.sleep(0.1)
    return _vllm_metric(server, "vllm:generation_tokens_total") - tokens


def test_client_disconnect_aborts_the_backend_request(proxy, vllm_server):
    def stream_then_leave():
        body = {"model": "tiny", "prompt": "count", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as resp:
            next(resp.iter_raw())  # the first chunk arrives, then the client hangs up

    generated = _generated_after(vllm_server, stream_then_leave)
    assert 0 < generated < LONG  # vLLM aborted it when the proxy closed the stream
    assert _proxy_metric(proxy, "cohort_in_flight") == 0  # its slot was freed, once


def test_client_that_leaves_a_non_streaming_request_aborts_it_at_the_backend(proxy, vllm_server):
    """A client timeout on a long non-streaming request: vLLM stops generating it."""
    def send_then_leave():
        body = json.dumps({"model": "tiny", "prompt": "count", "max_tokens": LONG, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            # wait until the proxy has sent it to vLLM (vLLM's own counters are published late, at its stats
            # interval: waiting for them let the request run to its end first), then let vLLM generate a while
            while _proxy_metric(proxy, "cohort_in_flight") < 1:
                assert time.monotonic() < deadline, "the request never reached vLLM"
                time.sleep(0.05)
            time.sleep(1.0)  # a few hundred of its LONG tokens
        # the client closed its connection without an answer (what a client timeout does)

    generated = _generated_after(vllm_server, send_then_leave)
    assert 0 < generated < LONG  # vLLM aborted it when the proxy cancelled the backend request
    assert _proxy_metric(proxy, "cohort_in_flight") == 0  # its slot was freed, once
    assert _proxy_metric(proxy, "cohort_requests_total", route="completion", status="499") >= 1


def _proxy_metric(proxy, sample, **labels):
    """The sum of the proxy's `sample` values with these labels (0 when it has none yet)."""
    families = text_string_to_metric_families(HTTP.get(proxy.url + "/metrics").text)
    return sum(s.value for f in families for s in f.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_proxy_metrics_and_health(proxy, client):
    assert httpx.get(proxy.url + "/health").json()["status"] == "ok"
    answered = _proxy_metric(proxy, "cohort_requests_total", route="chat", status="200")
    admitted = _proxy_metric(proxy, "cohort_queue_seconds_count")
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert _proxy_metric(proxy, "cohort_requests_total", route="chat", status="200") == answered + 1
    assert _proxy_metric(proxy, "cohort_queue_seconds_count") == admitted + 1  # admitted once
    assert _proxy_metric(proxy, "cohort_in_flight") == 0 and _proxy_metric(proxy, "cohort_waiting") == 0


def test_routes_a_vllm_client_expects_are_relayed(client, proxy):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as no_model:
        client.models.retrieve("nope")
    assert "'nope' does not exist" in no_model.value.message
    with pytest.raises(openai.NotFoundError) as no_embeddings:  # vLLM serves no embeddings for a generative model
        client.embeddings.create(model="tiny", input="hello")
    assert "POST /v1/embeddings: the backend answered 404" in no_embeddings.value.message
    raw = client.responses.with_raw_response.create(model="tiny", input="Write a poem", max_output_tokens=4)
    assert raw.parse().usage.output_tokens <= 4 and raw.headers["x-cohort-admission"].startswith("a")  # admitted
    events = [e.type for e in client.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    tokens = httpx.post(proxy.url + "/tokenize", json={"model": "tiny", "prompt": "1 2 3"}).json()["tokens"]
    text = httpx.post(proxy.url + "/detokenize", json={"model": "tiny", "tokens": tokens}).json()["prompt"]
    assert tokens and text == "1 2 3"
    assert httpx.get(proxy.url + "/version").json()["version"]
