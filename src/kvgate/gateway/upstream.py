"""The connection to the inference nodes: pooled sessions, timeouts, failure kinds.

Two :class:`aiohttp.ClientSession` objects, one for proxied requests (a large
pool) and one for the node watcher's probes (small, short timeouts), so a probe
never waits behind a burst of completions. TCP_NODELAY: aiohttp sets it on every
connection it makes or accepts (``aiohttp.base_protocol.BaseProtocol.connection_made``
is shared by the client's and the server's protocol), which matters here because a
stream of small SSE frames is exactly what Nagle's algorithm would delay;
``tests/gateway`` checks it on both sides.

How an attempt can fail before the first byte, and what the core calls it
(``FailureKind``; only the first three are retried on another node):

==========================================  ===================
connect refused / DNS / connect timeout     CONNECT_ERROR
503 without ``X-Kvgate-Reject`` (vLLM)      HTTP_503
503 + ``X-Kvgate-Reject: retry-elsewhere``  RETRY_ELSEWHERE
503 + ``X-Kvgate-Reject: pool-overloaded``  POOL_OVERLOADED
no response within the timeout              TIMEOUT
other 5xx, reset, protocol error            UPSTREAM_ERROR
4xx                                         CLIENT_ERROR
==========================================  ===================
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from yarl import URL

from kvgate.core.admission import FailureKind
from kvgate.gateway.config import NodesConfig, UpstreamConfig

REJECT_HEADER = "X-Kvgate-Reject"


def classify_status(status: int, headers: Mapping[str, str]) -> FailureKind:
    """The failure kind of a non-2xx answer from a node."""
    if status == 503:
        reject = headers.get(REJECT_HEADER, "").strip().lower()
        if reject == "pool-overloaded":
            return FailureKind.POOL_OVERLOADED
        if reject == "retry-elsewhere":
            return FailureKind.RETRY_ELSEWHERE
        return FailureKind.HTTP_503
    if 400 <= status < 500:
        return FailureKind.CLIENT_ERROR
    return FailureKind.UPSTREAM_ERROR


def classify_exception(exc: BaseException) -> FailureKind:
    """The failure kind of an exception raised while talking to a node."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return FailureKind.CONNECT_ERROR
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return FailureKind.TIMEOUT
    return FailureKind.UPSTREAM_ERROR


class Upstream:
    """The gateway's HTTP clients; create inside the running loop, ``close()`` on stop."""

    def __init__(self, config: UpstreamConfig, nodes: NodesConfig) -> None:
        self.config = config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.pool_limit, ttl_dns_cache=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
            auto_decompress=True,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies: skip the jar
        )
        self._urls: dict[tuple[str, str], URL] = {}
        probe_timeout = max(nodes.health_timeout_s, nodes.metrics_timeout_s)
        self.probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, ttl_dns_cache=60),
            timeout=aiohttp.ClientTimeout(total=probe_timeout,
                                          sock_connect=config.connect_timeout_s),
        )
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=config.connect_timeout_s,
            sock_read=config.stream_idle_timeout_s,
        )
        self._unary_timeout = aiohttp.ClientTimeout(
            total=config.request_timeout_s, sock_connect=config.connect_timeout_s
        )

    def timeout(self, stream: bool) -> aiohttp.ClientTimeout:
        return self._stream_timeout if stream else self._unary_timeout

    def url(self, base: str, path: str) -> URL:
        """``base + path`` parsed once (yarl parsing is a cost per request otherwise)."""
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:  # nodes come and go: never grow without bound
                self._urls.clear()
            url = self._urls[key] = URL(base + path)
        return url

    async def post(
        self, url: str | URL, body: bytes, headers: Mapping[str, str], *, stream: bool
    ) -> aiohttp.ClientResponse:
        """Send one attempt; returns once the response headers are in (raises on failure)."""
        return await self.session.post(
            url, data=body, headers=headers,
            timeout=self._stream_timeout if stream else self._unary_timeout,
            allow_redirects=False,
        )

    async def close(self) -> None:
        await self.session.close()
        await self.probe_session.close()
