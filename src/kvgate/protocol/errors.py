"""Protocol errors and OpenAI-shaped error bodies.

Every malformed input that reaches :mod:`kvgate.protocol` (a request body, a
KV-event frame, an SSE stream) raises a :class:`ProtocolError` subclass, never a
bare ``KeyError``/``IndexError``/``TypeError``. Each error knows the HTTP status
it maps to, the OpenAI ``type`` and ``code`` strings, and the offending
``param`` (OpenAI's dotted path, e.g. ``messages[0].role``), so the gateway can
turn it into a response with :meth:`ProtocolError.body`.

The body shape is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``
with ``code`` a string or ``null``. (vLLM uses the same keys but puts the
integer status in ``code`` and a class name in ``type``; kvgate emits OpenAI's
spelling for its own errors and passes engine bodies through untouched.)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatchedPromptError",
    "InvalidJSONError",
    "InvalidTypeError",
    "InvalidValueError",
    "KvEventWireError",
    "MissingParameterError",
    "ProtocolError",
    "RequestTooLargeError",
    "SSEError",
    "UnsupportedContentError",
    "UnsupportedParameterError",
    "authentication_error_body",
    "error_body",
    "invalid_request_body",
    "not_found_body",
    "overloaded_body",
    "rate_limit_body",
    "server_error_body",
    "type_name",
]

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ProtocolError(ValueError):
    """Bad input at the wire level. Maps to an HTTP 400 unless a subclass says otherwise.

    A plain class with class-level defaults (``http_status``, ``error_type``,
    ``default_code``) and per-instance ``message``, ``param`` and ``code``; the
    core may later re-parent it under its own error hierarchy.
    """

    http_status: int = 400
    error_type: str = INVALID_REQUEST
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped JSON body for this error."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidJSONError(ProtocolError):
    """The body is not JSON, not UTF-8, or not a JSON object."""


class RequestTooLargeError(ProtocolError):
    """The body is larger than the configured limit."""

    http_status = 413


class BodyTimeoutError(ProtocolError):
    """The body did not arrive in time (a client that trickles it, or sends none)."""

    http_status = 408
    default_code = "request_timeout"


class MissingParameterError(ProtocolError):
    default_code = "missing_required_parameter"


class InvalidTypeError(ProtocolError):
    default_code = "invalid_type"


class InvalidValueError(ProtocolError):
    default_code = "invalid_value"


class UnsupportedParameterError(ProtocolError):
    """A valid OpenAI value that kvgate does not support (e.g. ``n`` > 1)."""

    default_code = "unsupported_value"


class BatchedPromptError(UnsupportedParameterError):
    """A completions request with several prompts."""


class UnsupportedContentError(UnsupportedParameterError):
    """A chat content part that is not text (image, audio, file, ...)."""


class KvEventWireError(ProtocolError):
    """A malformed vLLM KV-event frame or payload."""


class SSEError(ProtocolError):
    """A malformed or oversized server-sent-event stream."""

    http_status = 502
    error_type = SERVER_ERROR


def type_name(value: object) -> str:
    """OpenAI's wording for a JSON value's type (``a string``, ``an integer``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` exactly as OpenAI sends it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request_body(
    message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """HTTP 400."""
    return error_body(message, INVALID_REQUEST, param, code)


def authentication_error_body(message: str | None = None) -> dict[str, Any]:
    """HTTP 401. OpenAI sends ``type: invalid_request_error`` with ``code: invalid_api_key``."""
    return error_body(
        message or "Incorrect API key provided.", INVALID_REQUEST, None, "invalid_api_key"
    )


def not_found_body(model: str | None = None, message: str | None = None) -> dict[str, Any]:
    """HTTP 404 for an unknown model (OpenAI: ``code: model_not_found``)."""
    if message is None:
        message = (
            f"The model `{model}` does not exist or you do not have access to it."
            if model is not None
            else "Not found."
        )
    return error_body(message, INVALID_REQUEST, "model" if model is not None else None,
                      "model_not_found" if model is not None else None)


def rate_limit_body(message: str | None = None, *, kind: str = "requests") -> dict[str, Any]:
    """HTTP 429. OpenAI sends ``type`` = the exhausted limit (``requests``/``tokens``)
    and ``code: rate_limit_exceeded``."""
    return error_body(
        message or "Rate limit reached for requests. Please try again later.",
        kind,
        None,
        "rate_limit_exceeded",
    )


def overloaded_body(message: str | None = None, code: str | None = None) -> dict[str, Any]:
    """HTTP 503: the cluster is saturated or not ready (OpenAI: ``type: server_error``)."""
    return error_body(
        message or "The server is currently overloaded, please try again later.",
        SERVER_ERROR,
        None,
        code,
    )


def server_error_body(message: str | None = None, code: str | None = None) -> dict[str, Any]:
    """HTTP 500/502."""
    return error_body(
        message or "The server had an error while processing your request.",
        SERVER_ERROR,
        None,
        code,
    )
