"""The moe-cohort routes of the vLLM server: what the engine is, and the expert counts of the requests the proxy marked.

A vLLM endpoint plugin (entry point `vllm.endpoint_plugins` `moe_cohort`; vLLM loads endpoint plugins
only when named: start vLLM with `VLLM_PLUGINS=moe_cohort`, which `cohort serve`'s embedded vLLM does).

    GET /v1/cohort/info
    -> 200 {"object": "cohort.engine_info", "schema": 1, ..., "observed_counts": true, ...}

The engine's description (keys: engine.engine_info), built once by the general plugin when vLLM built
the engine config in this process; 503 where it was not (an engine built some other way). The same facts
reach /metrics as `cohort_engine_info` even where this plugin is not loaded (there observed_counts is false).

The general plugin counts, in the engine's first worker, the experts of every request whose
`vllm_xargs.moe_observe` carries a token (engine.expert_counts); the second route reaches that worker through
vLLM's `collective_rpc` (the method `cohort_take_observed` the general plugin adds to vLLM's workers).

    POST /v1/cohort/observed  {"tokens": ["t1", "t2"]}
    -> 200 {"observed": {"t1": {"prompt_tokens": 12, "decode_tokens": 40, "counts": "<base64 .npy [2, L, E]>"}}}

A token whose request has not finished yet (or that the engine never saw) is left out; each request's
counts are handed over once. Why this path: it is the server the proxy already talks to, so it works the
same with the embedded vLLM and across containers or hosts, and it carries counts only, no text.
"""

from __future__ import annotations

import logging
from argparse import Namespace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

PATH = "/v1/cohort/observed"
INFO_PATH = "/v1/cohort/info"
MAX_TOKENS = 4096  # tokens per call


class ObservedEndpoint:
    """vLLM's EndpointPlugin protocol (vllm.plugins.endpoint_plugins.interface)."""

    name = "moe_cohort"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.post(PATH)(take_observed)
        app.get(INFO_PATH)(engine_info)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        state.cohort_engine = engine_client


async def take_observed(request: Request) -> JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        body = None
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or len(tokens) > MAX_TOKENS:
        return _error(f"send a JSON object {{\"tokens\": [...]}} with at most {MAX_TOKENS} strings (the moe_observe "
                      f"tokens of finished requests)")
    engine = getattr(request.app.state, "cohort_engine", None)
    if engine is None:
        return _error("this server has no engine", status=503)
    found: dict[str, dict] = {}
    for part in await engine.collective_rpc("cohort_take_observed", args=(tokens,)):
        found.update(part or {})  # the first tensor-parallel rank counts; the others answer {}
    return JSONResponse({"observed": found})


async def engine_info(request: Request) -> JSONResponse:
    from moe_cohort.engine.vllm_patches import STATE  # the general plugin's state in this process

    if STATE.engine_info is None:
        return _error("this server has no engine description (its engine config was not built by vLLM's "
                      "EngineArgs with the moe-cohort plugin registered)", status=503, param=None)
    return JSONResponse({**STATE.engine_info, "observed_counts": True})  # served here: this plugin is loaded


def _error(message: str, status: int = 400, param: str | None = "tokens") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)
