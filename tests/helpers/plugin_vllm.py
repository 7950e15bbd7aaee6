"""A stand-in vLLM with our plugin, and the routing behind it: a prompt about python routes every generated token
to experts 0, 1, one about cooking to 4, 5 (all layers); `plugin_backend` counts the experts of the requests
marked vllm_xargs.moe_observe and hands them over at POST /v1/cohort/observed, as the plugin does."""

from __future__ import annotations

import numpy as np

from tests.helpers.vllm_stub import answer, body_of

LAYERS, EXPERTS, K = 2, 8, 2
TOPICS = {"python": 0, "cooking": 4}  # a prompt about X routes every generated token to experts X, X + 1 (all layers)


def topic_routing(prompt: str, prompt_tokens: int = 5, generated: int = 6) -> np.ndarray:  # [tokens - 1, L, k] uint8
    first = TOPICS["python" if "python" in prompt else "cooking"]
    rows = np.zeros((prompt_tokens + generated - 1, LAYERS, K), np.uint8)
    rows[:prompt_tokens] = [7, 6]  # prompt tokens: experts the head must not learn as the answer's
    rows[prompt_tokens:] = [first, first + 1]
    return rows


def topic_prompt(i: int) -> str:
    return f"question {i} about {'python lists' if i % 2 else 'cooking rice'}"


def plugin_backend(seen_tokens: list):
    """A vLLM with our plugin: counts the experts of requests marked vllm_xargs.moe_observe, hands them over at
    POST /v1/cohort/observed (engine.observed_endpoint's format), streams when asked."""
    from moe_cohort.traces.observed import from_routed_experts

    done = {}

    async def handler(request):
        if request.method == "GET":
            return answer({})
        body = await body_of(request)
        if request.path == "/v1/cohort/observed":
            return answer({"observed": {t: done.pop(t) for t in body["tokens"] if t in done}})
        token = body.get("vllm_xargs", {}).get("moe_observe")
        seen_tokens.append(token)
        if token:
            done[token] = from_routed_experts(topic_routing(body["messages"][-1]["content"]), 5, EXPERTS).to_wire()
        if body.get("stream"):
            from aiohttp import web

            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\ndata: [DONE]\n\n')
            return response
        return answer({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})

    return handler
