"""The gateway's edge: every error becomes an OpenAI-shaped JSON response, here only.

``error_middleware`` wraps every handler (and aiohttp's own 404/405/413):

* :class:`~kvgate.protocol.ProtocolError` (bad body) -> its status (400/413) and body;
* :class:`~kvgate.core.errors.KvgateError` -> its ``http_status`` / ``error_type``
  (``AuthError`` -> 401 in OpenAI's ``invalid_api_key`` spelling);
* aiohttp's ``HTTPException`` (unknown route, method, body too large) -> the same
  status with an OpenAI body;
* anything else is our bug: logged with its traceback, answered 500, never leaked.

Backpressure is not an exception: :func:`reject_response` and :func:`fail_response`
turn the controller's ``Reject`` / ``Fail`` decisions into responses with
``Retry-After`` and ``x-should-retry``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from kvgate.core.admission import Rejected
from kvgate.core.decisions import Fail
from kvgate.core.errors import AuthError, KvgateError
from kvgate.edge import (
    REQUEST_ID_HEADER,
    ExpectCheck,
    client_request_id,
    endpoint_of,
    http_exception_response,
    json_response,
)
from kvgate.protocol import (
    ProtocolError,
    error_body,
    invalid_request_body,
    overloaded_body,
    rate_limit_body,
    server_error_body,
)

log = logging.getLogger("kvgate.gateway")

NODE_HEADER = "X-Kvgate-Node"
REASON_HEADER = "X-Kvgate-Route-Reason"
SHOULD_RETRY_HEADER = "x-should-retry"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Set by a handler that saw its client go away after the response started (a write
# failed): what it returns is counted as a 499, as when the disconnect cancels it.
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("kvgate_client_gone", bool)
# Set by a handler once its whole answer went out (a stream's end written): a
# cancellation after that (the client closed on [DONE] while the handler tidied up the
# node's connection) is no disconnect, and the response is counted with this status.
ANSWERED: web.RequestKey[int] = web.RequestKey("kvgate_answered", int)


def retry_after(seconds: float) -> str:
    return str(max(0, math.ceil(seconds)))


def reject_response(rejected: Rejected, headers: Mapping[str, str] | None = None) -> web.Response:
    """A stage-1 or routing rejection: 400 / 429 / 503 with Retry-After and x-should-retry."""
    status = rejected.http_status
    out = dict(headers or {})
    reason = rejected.reason.value
    if status == 429:
        body = rate_limit_body(rejected.message)
        body["error"]["code"] = reason
    elif status >= 500:
        body = overloaded_body(rejected.message, code=reason)
    else:
        body = invalid_request_body(rejected.message, code=reason)
    if status in (429, 503):
        out["Retry-After"] = retry_after(rejected.retry_after_s)
    if not rejected.retryable_by_client:
        out[SHOULD_RETRY_HEADER] = "false"
    return json_response(status, body, out)


def fail_response(fail: Fail, headers: Mapping[str, str] | None = None) -> web.Response:
    """The nodes failed the request and the gateway will not retry it.

    ``X-Kvgate-Node`` names the node that failed last, so a client retry can send
    ``X-Kvgate-Exclude-Node`` with it. A pool-overloaded answer must not be retried;
    any other 503 means the node never ran the request, which the client may retry.
    """
    out = dict(headers or {})
    if fail.node_id is not None:
        out[NODE_HEADER] = fail.node_id
    if fail.reason == "pool_overloaded":
        body = overloaded_body("All inference nodes are overloaded.", code=fail.reason)
        out[SHOULD_RETRY_HEADER] = "false"
    elif fail.http_status == 503:
        body = overloaded_body(
            f"The inference node {fail.node_id or ''} did not run the request "
            f"({fail.reason}); please retry.",
            code=fail.reason,
        )
    else:
        body = server_error_body(
            f"The inference node {fail.node_id or ''} failed the request ({fail.reason}).",
            code=fail.reason,
        )
    out["Retry-After"] = "1"
    return json_response(fail.http_status, body, out)


def refusing(
    check: Callable[[web.Request], object], *refusals: type[KvgateError]
) -> ExpectCheck:
    """An ``Expect: 100-continue`` check (``edge.expect_handler``) from a check that
    raises: one of ``refusals`` is the answer, before any body is invited."""

    def run(request: web.Request) -> web.StreamResponse | None:
        try:
            check(request)
        except refusals as exc:
            return error_response(exc)
        return None

    return run


def error_response(exc: BaseException) -> web.Response:
    """The one translator from an exception to an OpenAI-shaped response."""
    if isinstance(exc, ProtocolError):
        return json_response(exc.http_status, exc.body())
    if isinstance(exc, AuthError):
        body = error_body(exc.message, "invalid_request_error", None, exc.code)
        return json_response(401, body, {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, KvgateError):
        if exc.http_status >= 500:
            log.error("gateway error: %s", exc.message)
        return json_response(
            exc.http_status, error_body(exc.message, exc.error_type, exc.param, exc.code)
        )
    if isinstance(exc, web.HTTPException):
        return http_exception_response(exc)
    if isinstance(exc, ConnectionResetError):  # the client is gone; nobody reads this
        return web.Response(status=499)
    log.error("unhandled error in the gateway", exc_info=exc)
    return json_response(500, server_error_body())


def _with_request_id(request: web.Request, resp: web.Response) -> web.Response:
    rid = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    if rid is not None:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = error_response(exc)
    except Exception as exc:  # foreign exceptions: translated here, and only here
        resp = error_response(exc)
    return _with_request_id(request, resp)


def edge_middleware(responses: Counter[tuple[str, int]]) -> Any:
    """:func:`error_middleware` and the response counter (``responses[(endpoint,
    status)]``, 499 when the client went away before the end: the handler was
    cancelled, or it set :data:`CLIENT_GONE`) in one middleware: one layer per request
    instead of two."""

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = endpoint_of(request)
        status = 500
        try:
            try:
                resp: web.StreamResponse = await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = _with_request_id(request, error_response(exc))
            except asyncio.CancelledError:
                # client closed request (nginx's code), unless it had the whole answer
                status = request.get(ANSWERED, 499)
                raise
            except Exception as exc:  # foreign exceptions: translated here, and only here
                resp = _with_request_id(request, error_response(exc))
            status = 499 if request.get(CLIENT_GONE) else resp.status
            return resp
        finally:
            responses[(endpoint, status)] += 1

    return edge
