"""Keys on both sides of the proxy: the client keys it accepts, and the Authorization it sends to vLLM.

`Authorizer` checks a request's `Authorization: Bearer <key>` against the configured client keys and
returns the caller's *owner*, the identity the Batch API scopes files and batches by:

    --api-key KEY           owner "key:<sha256 hex of KEY>"  (one owner per key)
    --api-key KEY=TENANT    owner "tenant:TENANT"            (keys of one tenant share its files and
                                                              batches; rotating a key keeps them)
    no keys (open proxy)    owner ""                         (everyone is the one anonymous owner)

An entry is read as KEY=TENANT when the text after its last '=' is a tenant name (letters, digits,
'.', '_', '-'; at most 64), else the whole entry is the key: base64 keys ending in '=' work as they
are, and a key that contains '=name' is given with an explicit tenant (`a=b=team`). Keys are never
stored: owners are hashes or tenant names. Every request's key is hashed and compared with
`hmac.compare_digest` against every configured key's hash, whichever matches, so neither the
match's position nor the key's length shapes the time taken. `bearer` is the one place that builds
an Authorization header for the backend: batch requests send it with RunConfig.api_key, online ones
through `backend_headers` (the configured key, else the client's own).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Iterable, Mapping

from moe_cohort.send.errors import Unauthorized

ANONYMOUS = ""  # the owner of everything on an open proxy (and of records from before owners)
TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


class KeyListError(ValueError):
    """The configured keys are unusable (send.settings turns it into a SettingsError naming --api-key)."""


def key_owners(entries: Iterable[str]) -> dict[bytes, str]:
    """sha256(key) -> owner for the configured `--api-key` entries; KeyListError says what is wrong."""
    owners: dict[bytes, str] = {}
    for entry in entries:
        key, sep, tenant = entry.rpartition("=")
        if not (sep and TENANT.fullmatch(tenant)):
            key, tenant = entry, ""
        if not key.strip():
            raise KeyListError("has an empty key, which would let anyone in; give each --api-key as KEY or KEY=TENANT")
        digest = _digest(key.strip().encode())
        owner = f"tenant:{tenant}" if tenant else "key:" + digest.hex()
        if owners.setdefault(digest, owner) != owner:
            raise KeyListError(f"gives one key for two tenants ({owners[digest]!r} and {owner!r}); give each --api-key once")
    return owners


class Authorizer:
    """Callable on a request's headers: the caller's owner, or Unauthorized unless they carry a known key."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.owners = list(key_owners(keys).items())  # [(sha256 of a key, its owner)]

    def __call__(self, headers: Mapping[str, str]) -> str:
        if not self.owners:
            return ANONYMOUS
        scheme, _, key = headers.get("authorization", "").partition(" ")
        digest = _digest(_raw(key.strip()))
        owner = None
        for known, who in self.owners:  # all of them, always
            matched = hmac.compare_digest(digest, known)
            owner = who if matched else owner
        if scheme.lower() != "bearer" or owner is None:
            raise Unauthorized("missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return owner

    def allows(self, headers: Mapping[str, str]) -> bool:
        """Whether the headers carry a known key (always, on an open proxy)."""
        try:
            self(headers)
        except Unauthorized:
            return False
        return True


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _raw(header_value: str) -> bytes:
    """A header value's bytes (ASGI servers decode headers as latin-1; a UTF-8 key arrives that way)."""
    try:
        return header_value.encode("latin-1")
    except UnicodeEncodeError:
        return header_value.encode()


def bearer(key: str) -> dict[str, str]:
    """The Authorization header for `key`; none for an empty key."""
    return {"authorization": f"Bearer {key}"} if key else {}


def backend_headers(settings, client: Mapping[str, str] | None = None) -> dict[str, str]:
    """Headers for the backend: the configured backend key, else the client's own Authorization when the
    proxy itself takes no keys; and the client's x-request-id. `settings`: the send.settings.Settings
    (not imported: settings imports this module to check the keys)."""
    client = client or {}
    headers = bearer(settings.backend_api_key)
    if not settings.backend_api_key and not settings.api_keys and "authorization" in client:
        headers["authorization"] = client["authorization"]
    if "x-request-id" in client:
        headers["x-request-id"] = client["x-request-id"]
    return headers
