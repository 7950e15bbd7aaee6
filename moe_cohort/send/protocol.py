"""Incoming OpenAI requests: parse, check the few fields the proxy relies on, attach the policy.

The proxy checks only what it needs (a JSON object, `messages` or `prompt`, `stream`) and
leaves every other field to vLLM: unknown fields pass through untouched. The routing policy
comes from the `X-MoE-Routing` header, else from `vllm_xargs.moe_routing` in the body, else from
the server default; it is validated here (and checked against the operator's allowed policies) and sent
to vLLM as `vllm_xargs.moe_routing` in its canonical form. The keys the proxy owns (`moe_profile`,
`moe_record`) are dropped from what clients send unless the operator trusts them (send/hints.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator, Literal, Mapping

from moe_cohort.admission.wire import ROUTING_KEY, with_xargs
from moe_cohort.encoder.text import RequestTextError, request_text
from moe_cohort.engine.policy import PolicyError, parse_policy
from moe_cohort.send.errors import InvalidRequest, PayloadTooLarge
from moe_cohort.send.hints import HintRules

Route = Literal["chat", "completion", "responses"]
POLICY_HEADER = "x-moe-routing"


@dataclass(frozen=True)
class ProxyRequest:
    route: Route
    body: dict  # the client's body, vllm_xargs.moe_routing set to `policy`
    stream: bool
    policy: str  # canonical policy string

    @property
    def text(self) -> str:
        """What the encoder sees (encoder.text decides); "" when there is none (token-id prompts)."""
        try:
            return request_text(self.body.get("input") if self.route == "responses" else self.body)
        except RequestTextError:
            return ""


def check_size(content_length: str | None, max_bytes: int) -> None:
    """Reject a declared body size over the limit before reading it."""
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise PayloadTooLarge(_too_large(int(content_length), max_bytes))


async def limited(chunks: AsyncIterator[bytes], max_bytes: int, what: str = "request body",
                  fix: str = "shorten the request or raise the setting max_body_bytes (COHORT_MAX_BODY_BYTES)") -> AsyncIterator[bytes]:
    """`chunks` as they come, refused (413) as soon as their total passes `max_bytes`: a chunked body
    announces no size, so the limit applies while reading, not after."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"{what} is over the proxy's limit of {max_bytes} bytes ({size} bytes read "
                                  f"before it was refused); {fix}")
        yield chunk


async def read_body(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The whole request body, read no further than `max_bytes` (+ one chunk) before a 413."""
    return b"".join([chunk async for chunk in limited(chunks, max_bytes)])


async def read_request(chunks: AsyncIterator[bytes], headers: Mapping[str, str], route: Route, *, default_policy: str,
                       max_bytes: int, rules: HintRules = HintRules()) -> ProxyRequest:
    """The request of a generating route (chat, completion, responses): its body read no further than
    `max_bytes` (a 413 past it), validated, its routing policy attached."""
    check_size(headers.get("content-length"), max_bytes)
    raw = await read_body(chunks, max_bytes)
    return parse_request(raw, route, headers, default_policy=default_policy, max_bytes=max_bytes, rules=rules)


def parse_request(raw: bytes, route: Route, headers: Mapping[str, str], *, default_policy: str,
                  max_bytes: int, rules: HintRules = HintRules()) -> ProxyRequest:
    """Validate `raw` as a chat/completion/responses request body and attach the routing policy."""
    if len(raw) > max_bytes:
        raise PayloadTooLarge(_too_large(len(raw), max_bytes))
    body = json_object(raw)
    return prepare_body(body, route, headers, default_policy=default_policy, rules=rules)


def prepare_body(body: dict, route: Route, headers: Mapping[str, str], *, default_policy: str,
                 rules: HintRules = HintRules()) -> ProxyRequest:
    """Check an already-decoded request body and attach the routing policy (used for batch-file lines too)."""
    _check_fields(body, route)
    policy = engine_hints(body, headers, default_policy=default_policy, rules=rules)
    return ProxyRequest(route=route, body=body, stream=bool(body.get("stream", False)), policy=policy)


def engine_hints(body: dict, headers: Mapping[str, str], *, default_policy: str, rules: HintRules) -> str:
    """Set the engine hints of the body to forward (its `vllm_xargs`): the canonical routing policy, checked
    against `rules`, and none of the keys the proxy owns (send/hints.py); the policy."""
    if body.get("vllm_xargs") is not None and not isinstance(body["vllm_xargs"], dict):
        raise InvalidRequest("'vllm_xargs' must be an object", param="vllm_xargs")
    policy = _policy(body, headers, default_policy, rules)
    body["vllm_xargs"] = with_xargs(rules.client_xargs(body.get("vllm_xargs") or {}), **{ROUTING_KEY: policy})
    return policy


def json_object(raw: bytes) -> dict:
    """`raw` decoded as a JSON object; a 400 saying what is wrong otherwise."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON ({exc}); send a JSON object "
                             f"with Content-Type: application/json") from exc
    except RecursionError:  # json's C decoder refuses nesting deeper than the interpreter's recursion limit
        raise InvalidRequest("request body is JSON nested too deeply for the proxy to decode; "
                             "send a flatter JSON object") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: dict, route: Route) -> None:
    if route == "responses":
        pass  # `input` is vLLM's to check; the encoder reads what text it finds
    elif route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest("'messages' must be a non-empty list of message objects, e.g. "
                                 "[{\"role\": \"user\", \"content\": \"Hi\"}]", param="messages")
    elif not _is_prompt(body.get("prompt")):
        raise InvalidRequest("'prompt' must be a string, a list of strings or a list of token ids", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest(f"'stream' must be true or false, got {body['stream']!r}", param="stream")
    if "vllm_xargs" in body and body["vllm_xargs"] is not None and not isinstance(body["vllm_xargs"], dict):
        raise InvalidRequest("'vllm_xargs' must be an object", param="vllm_xargs")


def _is_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt:
        return all(isinstance(p, (str, int)) or (isinstance(p, list) and all(isinstance(t, int) for t in p))
                   for p in prompt)
    return False


def _policy(body: dict, headers: Mapping[str, str], default_policy: str, rules: HintRules) -> str:
    """The request's canonical policy: the header, else vllm_xargs.moe_routing, else the server's default;
    an error names where the bad value came from."""
    sent = (body.get("vllm_xargs") or {}).get(ROUTING_KEY)
    text, source = ((headers[POLICY_HEADER], "X-MoE-Routing") if headers.get(POLICY_HEADER)
                    else (sent, "vllm_xargs.moe_routing") if sent not in (None, "")
                    else (default_policy, "the server's --default-policy"))
    if not isinstance(text, str):
        raise InvalidRequest(f"{source} must be a string such as \"xshare;m=24\", got {type(text).__name__} {text!r}",
                             param=source, code="invalid_policy")
    try:
        policy = str(parse_policy(text))
    except PolicyError as exc:
        raise InvalidRequest(f"invalid routing policy {text!r} ({source}): {exc}", param=source,
                             code="invalid_policy") from exc
    from_client = source != "the server's --default-policy"
    if from_client and not rules.allows(policy) and policy != str(parse_policy(default_policy)):
        raise InvalidRequest(f"routing policy {policy!r} ({source}) is not allowed on this proxy; allowed: "
                             f"{', '.join(rules.policies)} (any parameters where only a name is listed), or leave "
                             f"it out for the server's default, {default_policy!r}", param=source,
                             code="policy_not_allowed")
    return policy


def _too_large(size: int, max_bytes: int) -> str:
    return (f"request body is {size} bytes, over the proxy's limit of {max_bytes} bytes; "
            f"shorten the request or raise the setting max_body_bytes (COHORT_MAX_BODY_BYTES)")
