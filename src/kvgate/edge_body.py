"""Request bodies as both apps take them (the gateway's ``body.read_body``, the
engine's): identity, gzip, x-gzip or deflate, at most ``client_max_size`` once decoded,
read in bounded steps so a compressed body cannot hold the event loop.

aiohttp decodes gzip and deflate in its parser, reads any other Content-Encoding as
identity, and its own ``read()`` inflates a body in steps as large as the size limit
with no turn between them; :func:`read_body_within` checks the coding first (415),
decodes x-gzip here, and gives up (413) as soon as the decoded body passes the limit.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import hdrs, web
from multidict import MultiMapping

__all__ = [
    "ENCODING_MESSAGE",
    "UnsupportedContentEncodingError",
    "body_coding",
    "decodable",
    "read_body_within",
]

ENCODING_MESSAGE = ("Unsupported Content-Encoding: send the body as identity, gzip or "
                    "deflate.")


class UnsupportedContentEncodingError(web.HTTPUnsupportedMediaType):
    """A body in a Content-Encoding neither app decodes: 415 (both apps answer aiohttp's
    HTTP errors through :func:`http_exception_response`)."""


# The codings a body may come in (RFC 9110 8.4.1; x-gzip is gzip's old name), one at
# most: aiohttp decodes gzip and deflate, reads any other value as identity (a
# "Content-Encoding: foo" body went on as if plain) and x-gzip is decoded here.
_BODY_CODINGS = frozenset({"", "identity", "gzip", "deflate", "x-gzip"})


def body_coding(headers: MultiMapping[str]) -> str:
    """The request body's Content-Encoding, lower case ("" for none); any coding but
    those of ``_BODY_CODINGS``, or more than one, raises a 415."""
    values = headers.getall(hdrs.CONTENT_ENCODING, [])
    coding = values[0].strip().lower() if len(values) == 1 else ""
    if len(values) > 1 or coding not in _BODY_CODINGS:
        raise UnsupportedContentEncodingError()
    return coding


def decodable(headers: MultiMapping[str]) -> bool:
    """Whether :func:`body_coding` takes the body's Content-Encoding."""
    try:
        body_coding(headers)
    except UnsupportedContentEncodingError:
        return False
    return True


# Decoded bytes between two turns given to the other connections while a body is read:
# a gzip body decodes in steps of aiohttp's read buffer (64 KiB) that follow each other
# without a pause while compressed bytes are in.
_YIELD_EVERY = 1 << 20


class _Gunzip:
    """x-gzip, decoded here (aiohttp reads it as identity), never past ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._size = 0
        self._inflate = zlib.decompressobj(wbits=31)
        self._member = False  # bytes of a gzip member whose end has not come

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        try:
            while data:
                self._member = True
                # at most one byte past the limit: enough to know it is too large
                piece = self._inflate.decompress(data, self._limit - self._size + 1)
                self._size += len(piece)
                out += piece
                if self._size > self._limit:
                    raise web.HTTPRequestEntityTooLarge(self._limit, self._size)
                if self._inflate.eof:  # members may follow each other (RFC 1952)
                    data = self._inflate.unused_data
                    self._inflate = zlib.decompressobj(wbits=31)
                    self._member = False
                else:
                    data = self._inflate.unconsumed_tail
        except zlib.error as exc:
            raise web.RequestPayloadError("invalid x-gzip body") from exc
        return bytes(out)

    def finish(self) -> None:
        if self._member:
            raise web.RequestPayloadError("truncated x-gzip body")


async def _read_capped(request: web.Request, gunzip: _Gunzip | None) -> bytes:
    """The whole body, decoded; 413 as soon as it passes ``client_max_size``. aiohttp's
    own ``read()`` raises the parser's inflate step to that size and gives no turn
    between steps: with a 16 MiB limit, a gzip of 1 GiB was inflated to 84 MB, the
    event loop blocked 0.36 s, before its 413 (here: 18 MB, 15 ms at most)."""
    limit = request.client_max_size
    content = request.content
    body = bytearray()
    since_turn = 0
    while chunk := await content.readany():
        if gunzip is not None:
            chunk = gunzip.feed(chunk)
        body += chunk
        if limit and len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(limit, len(body))
        since_turn += len(chunk)
        if since_turn >= _YIELD_EVERY:
            since_turn = 0
            await asyncio.sleep(0)  # a turn for the other connections
    if gunzip is not None:
        gunzip.finish()
    return bytes(body)


async def read_body_within(
    request: web.Request, timeout_s: float, timed_out: Callable[[], Exception]
) -> bytes:
    """The whole body, within ``timeout_s``; past it, the exception ``timed_out()`` makes
    fails the body and is raised. The rest of the body may still come: failed, its bytes
    are not read as the next request (the edge closes the connection after the answer).
    A Content-Encoding other than identity, gzip, x-gzip or deflate is a 415
    (:class:`UnsupportedContentEncodingError`), a body past ``client_max_size`` once
    decoded a 413 (``HTTPRequestEntityTooLarge``), one that does not decode a
    ``RequestPayloadError``. Both apps read bodies through it (the gateway's
    ``body.read_body``, the engine's)."""
    coding = body_coding(request.headers)
    gunzip = _Gunzip(request.client_max_size or 2**62) if coding == "x-gzip" else None
    if request.content.is_eof():  # the whole body is in already: no timer needed
        return await _read_capped(request, gunzip)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_capped(request, gunzip)
    except TimeoutError as exc:
        error = timed_out()
        request.content.set_exception(error)
        raise error from exc
