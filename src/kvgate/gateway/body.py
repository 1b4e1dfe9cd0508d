"""Reading a request body at the edge: every way it can fail is a 4xx, never a 500.

aiohttp reports a body it cannot decode (a gzip/deflate body that is not gzip or
deflate, a broken chunked framing) as ``RequestPayloadError`` from ``request.read()``;
a body that trickles in is bounded by ``server.body_timeout_s``. Both handlers that
read bodies (the proxy and the admin API) go through :func:`read_body`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvgate.core.errors import ClientRequestError


class RequestTimeoutError(ClientRequestError):
    http_status = 408


class MalformedBodyError(ClientRequestError):
    """The body's bytes could not be read as sent (encoding or framing): 400."""


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body; 408 past ``timeout_s``, 400 when it is badly encoded or framed
    (413 past ``client_max_size`` comes from aiohttp as ``HTTPRequestEntityTooLarge``)."""
    try:
        if request.content.is_eof():  # the whole body is in already: no timer needed
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError as exc:
        error = RequestTimeoutError("Timed out reading the request body.", code="request_timeout")
        # the rest of the body may still come: its bytes must not be read as the next
        # request, so the body is failed and the edge closes the connection after the 408
        request.content.set_exception(error)
        raise error from exc
    except web.RequestPayloadError as exc:
        # aiohttp's text can quote the client's bytes: say what failed in our words
        if "Content-Encoding" in request.headers:
            message = "The request body could not be decoded with its Content-Encoding."
        else:
            message = "The request body is malformed."
        raise MalformedBodyError(message, code="invalid_body") from exc
