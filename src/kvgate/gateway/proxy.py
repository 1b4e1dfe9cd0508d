"""``POST /v1/completions`` and ``POST /v1/chat/completions``: from HTTP to the core.

One request, in order (each step a 4xx when it fails, never a 500):

1. identify the caller (401 with auth on and a bad key), before its body is read;
2. read the body (413 past ``server.client_max_size``, 408 past
   ``server.body_timeout_s``, 400 when badly encoded or framed: body.py);
3. validate the body with :mod:`kvgate.protocol` (400 with OpenAI's ``param``);
4. resolve the priority (header over body, capped by the key), check the model
   exists somewhere (404), read ``X-Kvgate-Exclude-Node``;
5. build the core's ``RequestArrived`` (the prompt, or the chat messages, salted
   with ``cache_salt`` so salted requests never share a prefix with unsalted ones;
   token-id prompts as their decimal text with the exact token count) and the body
   to send upstream (``priority`` written in; ``stream_options.include_usage`` asked
   for on streams so the engine's ``cached_tokens`` reaches the gateway);
6. hand both to :class:`~kvgate.gateway.relay.Relay`, which admits, routes, sends,
   retries and streams.
"""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

from aiohttp import web

from kvgate.core.admission.types import NUM_CLASSES, shutting_down_rejection
from kvgate.core.errors import ClientRequestError
from kvgate.core.events import RequestArrived
from kvgate.core.ids import NodeId, RequestId
from kvgate.edge import REQUEST_ID_HEADER, client_request_id
from kvgate.gateway.body import check_json_body_type, read_body
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.errors import reject_response
from kvgate.gateway.identity import PRIORITY_HEADER, Authenticator
from kvgate.gateway.node_watcher import NodeWatcher
from kvgate.gateway.relay import Flight, Relay
from kvgate.protocol import (
    ChatRequest,
    CompletionRequest,
    edit_body,
    parse_chat_request,
    parse_completion_request,
)

EXCLUDE_HEADER = "X-Kvgate-Exclude-Node"
# Client headers worth passing to the engine (tracing and vLLM's session affinity).
FORWARDED_HEADERS = ("X-Session-ID", "traceparent", "tracestate", "baggage")
SALT_ROLE = "\x00cache_salt"


class RequestIds:
    """``kvg-<random per-process prefix>-<counter>``: unique across restarts and forked
    workers (a new prefix after a fork) at the cost of an increment, not a uuid4."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._prefix = ""
        self._count = itertools.count()
        self.reset()

    def reset(self) -> None:
        self._prefix = f"kvg-{secrets.token_hex(8)}-"
        self._count = itertools.count(1)

    def next(self) -> RequestId:
        return RequestId(f"{self._prefix}{next(self._count):x}")


request_ids = RequestIds()
os.register_at_fork(after_in_child=request_ids.reset)


class ModelNotFoundError(ClientRequestError):
    http_status = 404


class CompletionsHandler:
    """The two OpenAI endpoints; stateless apart from the parts it is given."""

    def __init__(
        self, config: GatewayConfig, auth: Authenticator, watcher: NodeWatcher, relay: Relay
    ) -> None:
        self.config = config
        self.auth = auth
        self.watcher = watcher
        self.relay = relay
        self._max_body = config.server.client_max_size
        self._body_timeout = config.server.body_timeout_s
        # watcher.serves(model) per model, valid while the node table's version (which
        # counts membership and spec changes, the only inputs of serves) is unchanged
        self._serves: dict[str, bool] = {}
        self._serves_version = -1

    def stopping(self) -> bool:
        """Whether the gateway is stopping (read anew after each await)."""
        return self.relay.driver.draining

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if self.stopping():  # another gateway may take it at once
            return reject_response(shutting_down_rejection())
        # the key first: an unknown caller's body is never waited for nor buffered
        identity = self.auth.identify(request.headers)
        check_json_body_type(request.headers)
        body = await read_body(request, self._body_timeout)
        if self.stopping():  # the stop began while the body arrived
            return reject_response(shutting_down_rejection())
        parsed: ChatRequest | CompletionRequest
        if chat:
            parsed = parse_chat_request(body, max_body_bytes=self._max_body)
        else:
            parsed = parse_completion_request(body, max_body_bytes=self._max_body)
        priority = self.auth.priority(
            identity, request.headers.get(PRIORITY_HEADER), parsed.priority
        )
        if not self._model_served(parsed.model):
            raise ModelNotFoundError(
                f"The model `{parsed.model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        rid = request_ids.next()
        client_rid = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or rid
        prompt_form = _prompt_form(parsed)
        arrived = RequestArrived(
            request_id=rid,
            tenant=identity.tenant,
            priority=priority,
            bypass=identity.bypass,
            model=parsed.model,
            max_tokens=parsed.max_tokens or self.config.routing.default_max_tokens,
            max_tokens_given=parsed.max_tokens is not None,
            excluded_nodes=_excluded(request.headers.get(EXCLUDE_HEADER)),
            **prompt_form,
        )
        edits: dict[str, Any] = {}
        upstream = self.config.upstream
        if upstream.forward_priority:
            # the node's own priority value for the class (the classes run P0 first)
            high_first = upstream.priority_order == "high_first"
            sent = NUM_CLASSES - 1 - priority if high_first else priority
            if parsed.raw.get("priority") != sent:
                edits["priority"] = sent
        if parsed.stream and not parsed.include_usage:
            edits["stream_options"] = {"include_usage": True}
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if parsed.stream else "application/json",
            REQUEST_ID_HEADER: client_rid,
        }
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        flight = Flight(
            rid=rid,
            client_rid=client_rid,
            path="/v1/chat/completions" if chat else "/v1/completions",
            body=edit_body(body, parsed.raw, edits) if edits else body,
            stream=parsed.stream,
            wants_usage=parsed.include_usage,
            headers=headers,
            priority=priority,
        )
        return await self.relay.run(request, flight, arrived)


    def _model_served(self, model: str) -> bool:
        version = self.watcher.controller.nodes.version
        cache = self._serves
        if version != self._serves_version:
            cache.clear()
            self._serves_version = version
        else:
            hit = cache.get(model)
            if hit is not None:
                return hit
        served = self.watcher.serves(model)
        if len(cache) >= 64:  # model names come from clients: keep it bounded
            cache.clear()
        cache[model] = served
        return served


def _prompt_form(parsed: ChatRequest | CompletionRequest) -> dict[str, Any]:
    salt = parsed.cache_salt
    if isinstance(parsed, ChatRequest):
        messages = parsed.messages
        if salt is not None:
            messages = ((SALT_ROLE, salt), *messages)
        return {"messages": messages}
    head = f"{SALT_ROLE}{salt}\x00" if salt is not None else ""
    if parsed.prompt_text is not None:
        return {"prompt": head + parsed.prompt_text}
    ids = parsed.prompt_token_ids or ()
    form: dict[str, Any] = {"prompt": head + " ".join(map(str, ids)), "prompt_tokens": len(ids)}
    if salt is None:  # a token hasher chains the ids as the engine caches them
        form["prompt_token_ids"] = tuple(ids)
    return form


def _excluded(header: str | None) -> frozenset[NodeId]:
    if not header:
        return frozenset()
    return frozenset(NodeId(p.strip()) for p in header.split(",") if p.strip())
