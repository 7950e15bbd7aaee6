"""The cohort key (send/cohort_key.py): its SimHash properties, and the `x-cohort-key` header reaching the
backend through the proxy (the official client, a throwaway backend that records headers)."""

import asyncio

import httpx
import numpy as np
import openai
import pytest
from aiohttp import web

from moe_cohort.admission.wire import Prediction
from moe_cohort.proxy.app import create_app
from moe_cohort.send.cohort_key import HEADER, cohort_key, cohort_key_header
from moe_cohort.send.settings import Settings
from tests.helpers.vllm_stub import answer, body_of, local_backend

OK_BODY = {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
           "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}]}


def bits_apart(a: int, b: int) -> int:
    return bin(a ^ b).count("1")


def test_the_key_is_a_stable_16_bit_number_that_ignores_scale():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(384)
    key = cohort_key(v)
    assert 0 <= key < 2 ** 16 and cohort_key(v.copy()) == key and cohort_key(3.5 * v) == key
    assert cohort_key(v.astype(np.float32)) == key and 0 <= cohort_key(v, bits=4) < 16
    with pytest.raises(ValueError, match="non-empty finite"):
        cohort_key(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="bits must be in 1..52"):
        cohort_key(v, bits=64)


def test_alike_vectors_share_keys_and_unlike_ones_do_not():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 384))
    near_a = [cohort_key(a + 0.02 * rng.standard_normal(384)) for _ in range(50)]
    assert sum(k == cohort_key(a) for k in near_a) >= 40  # a few bits may flip near a hyperplane
    assert np.mean([bits_apart(k, cohort_key(a)) for k in near_a]) < 0.5
    assert bits_apart(cohort_key(a), cohort_key(b)) >= 3  # independent directions: ~8 of 16 bits differ


def test_non_negative_profiles_with_different_experts_get_different_keys():
    # [L*E] = 4 layers x 16 experts; the common non-negative component is removed before hashing
    def profile(experts):
        p = np.full((4, 16), 0.01)
        p[:, experts] = 1.0
        return p.ravel()

    same = [cohort_key(profile([0, 1]) + 0.01 * np.random.default_rng(s).random(64)) for s in range(10)]
    assert len(set(same)) <= 2
    assert bits_apart(cohort_key(profile([0, 1])), cohort_key(profile([8, 9]))) >= 3
    # positive vectors dominated by their common part: without the centring nearly all share one or two keys
    profiles = 1.0 + 0.1 * np.random.default_rng(2).random((200, 64))
    assert len({cohort_key(p) for p in profiles}) >= 50


def test_the_header_comes_from_the_predicted_vector_or_not_at_all():
    assert cohort_key_header(None) == {}
    flat = np.linspace(-1, 1, 32)
    assert cohort_key_header(Prediction(flat)) == {HEADER: str(cohort_key(flat))}


def proxy_run(encoder: str, calls):
    """Run `calls(client)` with the official client against the in-process proxy; the headers the backend saw."""
    seen = []

    async def backend(request: web.BaseRequest) -> web.StreamResponse:
        body = await body_of(request)
        seen.append((body["messages"][0]["content"], dict(request.headers)))
        if not body.get("stream"):
            return answer(OK_BODY)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"tiny",'
                             b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    async def main():
        async with local_backend(backend) as url:
            app = create_app(Settings(backends=(url,), encoder=encoder, forward_profiles=True, learn=False,
                                      profile_deadline_ms=60_000))  # every request carries its key, however slow
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as h:
                    await calls(openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="k", max_retries=0, http_client=h))
            finally:
                await app.state.proxy.close()

    asyncio.run(main())
    return seen


def chat(content, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


@pytest.mark.integration
def test_the_cohort_key_reaches_the_backend_for_plain_and_streamed_requests(monkeypatch):
    pytest.importorskip("sentence_transformers")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    math = "What is 12 plus 30? Solve the arithmetic problem step by step."
    poem = "Write a short poem about the moon and the sea at night."

    async def calls(client):
        for text in (math, poem, math):
            await client.chat.completions.create(**chat(text))
        stream = await client.chat.completions.create(**chat(math, stream=True))
        assert [c.choices[0].delta.content async for c in stream] == ["hi"]

    seen = proxy_run("", calls)  # the default encoder (the packaged MiniLM): admissions carry embeddings
    keys = [headers.get(HEADER) for _, headers in seen]
    assert all(k is not None and k.isdigit() and int(k) < 2 ** 16 for k in keys), keys
    assert keys[0] == keys[2] == keys[3] != keys[1]  # the same prompt, plain or streamed: the same key


def test_no_encoder_no_header():
    async def calls(client):
        await client.chat.completions.create(**chat("hello"))
        await client.chat.completions.create(**chat("hello", stream=True))

    seen = proxy_run("none", calls)
    assert len(seen) == 2 and all(HEADER not in headers for _, headers in seen)
