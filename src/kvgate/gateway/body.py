"""Reading a request body at the edge: every way it can fail is a 4xx, never a 500.

``edge_body.read_body_within`` reads it: a body it cannot decode (a gzip/deflate body that
is not gzip or deflate, a broken chunked framing) is a ``RequestPayloadError`` (400
here), a Content-Encoding other than identity, gzip, x-gzip or deflate a 415, a body
past ``server.client_max_size`` once decoded a 413 (both aiohttp ``HTTPException``
answered by the error middleware); a body that trickles in is bounded by
``server.body_timeout_s``. Both handlers that read bodies (the proxy and the admin
API) go through :func:`read_body`.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from kvgate.core.errors import ClientRequestError
from kvgate.edge_body import read_body_within


class RequestTimeoutError(ClientRequestError):
    http_status = 408


class MalformedBodyError(ClientRequestError):
    """The body's bytes could not be read as sent (encoding or framing): 400."""


class UnsupportedMediaTypeError(ClientRequestError):
    """A body declared as a form or as text/plain: 415."""

    http_status = 415


# The types a browser posts cross-site without asking the server first (CORS's
# "simple" requests): an HTML form's two and text/plain.
_SIMPLE_TYPES = frozenset(
    {"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"}
)


def check_json_body_type(headers: Mapping[str, str]) -> None:
    """Refuse (415) a body declared as a form or as text/plain: a web page can make its
    visitor's browser post those to any address without a CORS preflight, so it could
    drive a gateway on the operator's network (when no API key is needed). vLLM and
    SGLang refuse them too; JSON, none declared, or any other type is read as JSON."""
    declared = headers.get("Content-Type")
    if declared is not None and declared.split(";", 1)[0].strip().lower() in _SIMPLE_TYPES:
        raise UnsupportedMediaTypeError(
            "The request body must be JSON (Content-Type: application/json).",
            code="unsupported_media_type",
        )


def _timed_out() -> RequestTimeoutError:
    return RequestTimeoutError("Timed out reading the request body.", code="request_timeout")


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body; 408 past ``timeout_s``, 400 when it is badly encoded or framed
    (413 past ``client_max_size`` and 415 for an unsupported Content-Encoding come as
    aiohttp's ``HTTPRequestEntityTooLarge`` / ``HTTPUnsupportedMediaType``)."""
    try:
        return await read_body_within(request, timeout_s, _timed_out)
    except web.RequestPayloadError as exc:
        # aiohttp's text can quote the client's bytes: say what failed in our words
        if "Content-Encoding" in request.headers:
            message = "The request body could not be decoded with its Content-Encoding."
        else:
            message = "The request body is malformed."
        raise MalformedBodyError(message, code="invalid_body") from exc
