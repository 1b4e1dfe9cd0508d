"""The connection to the inference nodes: pooled clients, timeouts, failure kinds.

Proxied requests go through one of two clients, chosen by ``upstream.client``:

* ``lean`` (the default): :class:`~kvgate.gateway.lean_http.LeanClient`, keep-alive
  pools per node on aiohttp's own protocol and response parser, without the general
  machinery of :class:`aiohttp.ClientSession` (a quarter of the gateway's CPU);
* ``aiohttp``: a :class:`aiohttp.ClientSession` with a large pool.

Both answer with an object carrying what the relay reads (:class:`UpstreamResponse`)
and fail with aiohttp's client exceptions, so one relay and one
:func:`classify_exception` serve both. The node watcher's probes always use their own
small :class:`aiohttp.ClientSession` with short timeouts, so a probe never waits
behind a burst of completions. TCP_NODELAY: aiohttp sets it on every connection it
makes or accepts (``aiohttp.base_protocol.BaseProtocol.connection_made`` is shared by
the client's and the server's protocol, and the lean client uses the same protocol),
which matters here because a stream of small SSE frames is exactly what Nagle's
algorithm would delay; ``tests/gateway`` checks it on both sides, for both clients.

How an attempt can fail before the first byte, and what the core calls it
(``FailureKind``; only the first three and NODE_AUTH are retried on another node):

==========================================  ===================
connect refused / DNS / connect timeout     CONNECT_ERROR
503 without ``X-Kvgate-Reject`` (vLLM)      HTTP_503
503 + ``X-Kvgate-Reject: retry-elsewhere``  RETRY_ELSEWHERE
503 + ``X-Kvgate-Reject: pool-overloaded``  POOL_OVERLOADED
no response within the timeout              TIMEOUT
other 5xx, reset, protocol error            UPSTREAM_ERROR
429                                         RATE_LIMITED
401, 403, 407 (our credentials refused)     NODE_AUTH
other 4xx (the client's own bad request)    CLIENT_ERROR
==========================================  ===================

A CLIENT_ERROR is the client's fault, not the node's: it counts toward neither the
cluster breaker nor the node's ejection, and is passed through as the node sent it.
A node's 401 / 403 / 407 is not: the client's ``Authorization`` is never forwarded,
so the node refused the gateway's own key for it (``nodes[].api_key``), and would
refuse every request. It counts toward the node's ejection, and the request is
retried elsewhere; the client never sees the node's refusal as its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Protocol

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from kvgate.core.admission import FailureKind
from kvgate.gateway.config import NodesConfig, UpstreamConfig
from kvgate.gateway.lean_http import LeanClient, Target, UpstreamConnectError
from kvgate.protocol.node_reject import REJECT_HEADER, RejectKind


class UpstreamResponse(Protocol):
    """What the relay reads of an answer (both clients' responses have it)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content(self) -> aiohttp.StreamReader: ...

    @property
    def content_type(self) -> str: ...

    def release(self) -> object: ...

    def close(self) -> None: ...


# what a node answers when it refuses the gateway's credentials for it
NODE_AUTH_STATUSES = frozenset({401, 403, 407})


def classify_status(status: int, headers: Mapping[str, str]) -> FailureKind:
    """The failure kind of a non-2xx answer from a node."""
    if status == 503:
        reject = headers.get(REJECT_HEADER, "").strip().lower()
        if reject == RejectKind.POOL_OVERLOADED.value:
            return FailureKind.POOL_OVERLOADED
        if reject == RejectKind.RETRY_ELSEWHERE.value:
            return FailureKind.RETRY_ELSEWHERE
        return FailureKind.HTTP_503
    if status == 429:
        return FailureKind.RATE_LIMITED
    if status in NODE_AUTH_STATUSES:
        return FailureKind.NODE_AUTH
    if 400 <= status < 500:
        return FailureKind.CLIENT_ERROR
    return FailureKind.UPSTREAM_ERROR


def classify_exception(exc: BaseException) -> FailureKind:
    """The failure kind of an exception raised while talking to a node."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError
                  | UpstreamConnectError):
        return FailureKind.CONNECT_ERROR
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return FailureKind.TIMEOUT
    return FailureKind.UPSTREAM_ERROR


class Upstream:
    """The gateway's HTTP clients; create inside the running loop, ``close()`` on stop."""

    def __init__(self, config: UpstreamConfig, nodes: NodesConfig) -> None:
        self.config = config
        self.lean: LeanClient | None = None
        self.session: aiohttp.ClientSession | None = None
        if config.client == "lean":
            self.lean = LeanClient(
                connect_timeout_s=config.connect_timeout_s,
                limit=config.pool_limit,
                keepalive_s=config.keepalive_s,
            )
        else:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=config.pool_limit, ttl_dns_cache=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
                auto_decompress=True,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies: skip the jar
            )
        self._urls: dict[tuple[str, str], URL | Target] = {}
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

    def url(self, base: str, path: str) -> URL | Target:
        """``base + path`` parsed once (URL parsing is a cost per request otherwise)."""
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:  # nodes come and go: never grow without bound
                self._urls.clear()
            full = base + path
            url = self._urls[key] = URL(full) if self.lean is None else self.lean.target(full)
        return url

    def post(
        self, url: str | URL | Target, body: bytes, headers: Mapping[str, str], *, stream: bool
    ) -> Awaitable[UpstreamResponse]:
        """Send one attempt; the awaitable ends once the response headers are in (raises
        on failure). Not a coroutine itself: one frame less on every resumption."""
        lean = self.lean
        if lean is not None:
            target = url if isinstance(url, Target) else lean.target(url)
            config = self.config
            if stream:
                return lean.request(target, body, headers,
                                    read_timeout=config.stream_idle_timeout_s)
            return lean.request(target, body, headers, total_timeout=config.request_timeout_s)
        assert self.session is not None
        return self.session.post(
            url.url if isinstance(url, Target) else url, data=body, headers=headers,
            timeout=self._stream_timeout if stream else self._unary_timeout,
            allow_redirects=False,
        )

    async def close(self) -> None:
        if self.lean is not None:
            await self.lean.close()
        if self.session is not None:
            await self.session.close()
        await self.probe_session.close()
