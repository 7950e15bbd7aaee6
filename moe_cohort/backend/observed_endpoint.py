"""`POST /v1/cohort/observed` on the vLLM server: the proxy takes the expert counts of the requests it marked.

A vLLM endpoint plugin (entry point `vllm.endpoint_plugins` `moe_cohort`; vLLM loads endpoint plugins
only when named: start vLLM with `VLLM_PLUGINS=moe_cohort`, which `cohort serve`'s embedded vLLM does).
The general plugin counts, in the engine's first worker, the experts of every request whose
`vllm_xargs.moe_observe` carries a token (backend.expert_counts); this route reaches that worker through
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
MAX_TOKENS = 4096  # tokens per call


class ObservedEndpoint:
    """vLLM's EndpointPlugin protocol (vllm.plugins.endpoint_plugins.interface)."""

    name = "moe_cohort"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.post(PATH)(take_observed)

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


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": "tokens",
                                   "code": None}}, status_code=status)
