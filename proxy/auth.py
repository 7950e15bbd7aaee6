"""Keys on both sides of the proxy: the client keys it accepts, and the Authorization it sends to vLLM.

`Authorizer` checks a request's `Authorization: Bearer <key>` against the configured client keys
(none configured: the proxy is open). `bearer` is the one place that builds an Authorization header
for the backend: batch requests send it with RunConfig.api_key, online ones through `backend_headers`
(the configured key, else the client's own).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from proxy.errors import Unauthorized
from proxy.settings import Settings


class Authorizer:
    """Callable on a request's headers; raises Unauthorized unless they carry one of `keys`."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = frozenset(keys)

    def __call__(self, headers: Mapping[str, str]) -> None:
        if not self.keys:
            return
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.keys:
            raise Unauthorized("missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")


def bearer(key: str) -> dict[str, str]:
    """The Authorization header for `key`; none for an empty key."""
    return {"authorization": f"Bearer {key}"} if key else {}


def backend_headers(settings: Settings, client: Mapping[str, str] | None = None) -> dict[str, str]:
    """Headers for the backend: the configured backend key, else the client's own Authorization when the
    proxy itself takes no keys; and the client's x-request-id."""
    client = client or {}
    headers = bearer(settings.backend_api_key)
    if not settings.backend_api_key and not settings.api_keys and "authorization" in client:
        headers["authorization"] = client["authorization"]
    if "x-request-id" in client:
        headers["x-request-id"] = client["x-request-id"]
    return headers
