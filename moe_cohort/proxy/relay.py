"""Routes the proxy relays to the backend as they are, for clients that expect a vLLM/OpenAI server.

    GET  /v1/models               the healthy replicas' model lists, merged by id
    GET  /v1/models/{model}       one model of that list (client.models.retrieve); 404 when not there
    POST /v1/embeddings           relayed, unplanned (no generation to plan)
    POST /tokenize, /detokenize   relayed, unplanned, to a healthy replica (in turn)
    GET  /version                 relayed

What the backend does not offer answers with the backend's own status in the OpenAI error shape (vLLM
answers {"detail": "Not Found"} for /v1/embeddings on a generative model: a 404 naming the route).
"""

from __future__ import annotations


from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from moe_cohort.send.auth import backend_headers
from moe_cohort.send.errors import NotFound
from moe_cohort.send.protocol import json_object

POST_ROUTES = ("/v1/embeddings", "/tokenize", "/detokenize")


def add_relay_routes(app: FastAPI, proxy) -> None:
    """Add the relayed routes to `app`; `proxy` is the app's proxy.app.Proxy."""

    async def relay(request: Request, method: str, path: str, body: bytes | None = None) -> Response:
        answer = await proxy.replicas.any_client().request(method, path, json=None if body is None else json_object(body),
                                                    headers=backend_headers(proxy.settings, request.headers))
        return Response(answer.content, status_code=answer.status_code, media_type=answer.content_type)

    async def listed(request: Request) -> dict:
        """The healthy replicas' model lists merged by model id (one backend: its list)."""
        return await proxy.replicas.models(backend_headers(proxy.settings, request.headers))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        proxy.authorize(request.headers)
        return JSONResponse(await listed(request))

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        proxy.authorize(request.headers)
        for entry in (await listed(request)).get("data", []):
            if entry.get("id") == model:
                return JSONResponse(entry)
        raise NotFound(f"the model {model!r} does not exist at the backend; GET /v1/models lists the served ones",
                       param="model", code="model_not_found")

    @app.get("/version")
    async def version(request: Request) -> Response:
        proxy.authorize(request.headers)
        return await relay(request, "GET", "/version")

    async def relay_post(request: Request) -> Response:
        return await relay(request, "POST", request.url.path, await proxy.body(request))

    for path in POST_ROUTES:
        app.add_api_route(path, relay_post, methods=["POST"])
