"""One exception hierarchy, one table to HTTP status, one JSON body shape.

Body (OpenAI-style, so SDK clients surface the message)::

    {"error": {"message": "...", "type": "invalid_request", "code": 400, "param": "images[0]"}}
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "code": self.status}
        if self.param:
            err["param"] = self.param
        return {"error": err}


class BadRequest(ServiceError):
    status, type = 400, "invalid_request"


class NotFound(ServiceError):
    status, type = 404, "not_found"


class Unauthorized(ServiceError):
    """No API key, or not one the server accepts (``--api-key``): 401 with a Bearer challenge, gRPC
    UNAUTHENTICATED."""

    status, type = 401, "unauthorized"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param,
                         headers={"WWW-Authenticate": 'Bearer realm="softmoe-serve"', **(headers or {})})


class ClosesConnection(ServiceError):
    """An error after which the rest of the client's request is not read: the connection closes."""

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param, headers={"Connection": "close", **(headers or {})})


class RequestTimeout(ClosesConnection):
    """The client did not send its whole request in time (its head within ``header_timeout_s``, its
    body at ``min_body_rate`` and before the request's deadline): 408."""

    status, type = 408, "request_timeout"


class PayloadTooLarge(ServiceError):
    status, type = 413, "payload_too_large"


class HeadersTooLarge(ClosesConnection):
    """A request head over ``max_header_bytes``: 431."""

    status, type = 431, "headers_too_large"


class UnsupportedMediaType(ServiceError):
    status, type = 415, "unsupported_media_type"


class Conflict(ServiceError):
    """The request cannot run in the server's present state (a load of the model already running, an
    unload of a model not loaded, model control off): 409, gRPC FAILED_PRECONDITION."""

    status, type = 409, "conflict"


class Unprocessable(ServiceError):
    status, type = 422, "invalid_request"


class QueueFull(ServiceError):
    status, type = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})


class Unavailable(ServiceError):
    status, type = 503, "unavailable"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})


class DeadlineExceeded(ServiceError):
    status, type = 504, "deadline_exceeded"


class ClientDisconnected(ServiceError):
    """The client left before its result was ready (nginx's 499); nobody reads the response."""

    status, type = 499, "client_disconnected"


class BackendFailure(Unavailable):
    """A transient backend failure (out of memory, a timeout): 503 with Retry-After, nothing retried."""


class InferenceFailed(ServiceError):
    """A deterministic backend failure of one item (found by bisecting its batch): 500 for that
    item's request only, without Retry-After (the same input fails the same way again). The
    exception text is logged with the request id, never sent to the client."""

    status, type = 500, "inference_failed"


class ModelLoadError(Exception):
    """A model could not be loaded: at start-up the server does not start; a load request gets 400
    naming the problem and changes nothing."""
