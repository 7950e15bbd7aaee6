"""The send path's exception tree (the proxy's and the batch runner's); each error knows its HTTP status and
renders the OpenAI error shape.

    ServiceError
    ├── InvalidRequest      400  bad JSON, bad fields, bad routing policy
    ├── Unauthorized        401  missing or wrong proxy API key
    ├── NotFound            404  no such file or batch (Batch API)
    ├── PayloadTooLarge     413  body over the size limit
    ├── NotReady            503  `cohort serve` is still loading its encoder (proxy/http/starting.py)
    └── BackendError
        ├── BackendUnreachable  502  connection refused / reset / DNS
        ├── BackendTimeout      504  no answer within the timeout
        └── BackendStatusError  the backend's own 4xx/5xx, passed through unchanged

Transport errors are translated at the boundary (`raise BackendUnreachable(...) from exc`).
"""

from __future__ import annotations

import json

CLIENT_CLOSED = 499  # the client left before its answer (nginx's code): an outcome, never sent


class ServiceError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}: the OpenAI error shape."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(ServiceError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(ServiceError):
    status_code = 401
    error_type = "invalid_request_error"


class NotFound(ServiceError):
    status_code = 404
    error_type = "invalid_request_error"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error_type = "invalid_request_error"


class NotReady(ServiceError):
    status_code = 503
    error_type = "service_unavailable"


class BackendError(ServiceError):
    status_code = 502
    error_type = "backend_error"


class BackendUnreachable(BackendError):
    status_code = 502

    def __init__(self, message: str, *, answer_started: bool = True, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.answer_started = answer_started  # False: the connection failed before any byte of the answer came back


class BackendTimeout(BackendError):
    status_code = 504
    error_type = "timeout"


class BackendStatusError(BackendError):
    """The backend answered with an error status; `content` is its body, relayed as is."""

    def __init__(self, status_code: int, content: bytes, content_type: str = "application/json") -> None:
        super().__init__(f"backend answered {status_code}")
        self.status_code, self.content, self.content_type = status_code, content, content_type

    def openai_content(self, what: str) -> tuple[bytes, str]:
        """(body, media type) to relay: the backend's own body when it is an OpenAI error, else the same
        status in that shape, quoting the backend (e.g. vLLM's {"detail": "Not Found"} for a route it
        does not offer); `what` names the request ("POST /v1/embeddings")."""
        try:
            body = json.loads(self.content)
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return self.content, self.content_type
        detail = body.get("detail", body) if isinstance(body, dict) else self.content.decode("utf-8", "replace")[:500]
        message = f"{what}: the backend answered {self.status_code} ({detail})"
        if self.status_code == 404:
            message += "; the backend does not offer this route or resource"
        error = ServiceError(message, code=str(self.status_code))
        error.error_type = "invalid_request_error" if self.status_code < 500 else "backend_error"
        return json.dumps(error.body()).encode(), "application/json"
