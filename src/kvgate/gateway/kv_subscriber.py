"""The I/O half of precise mode: one ZMQ SUB socket per node, read on the event loop.

The engine publishes ``[topic, seq, msgpack batch]`` on a PUB socket (vLLM's
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``, or ``kvgate engine --kv-events-endpoint``). The
subscriber connects to it (ZMQ reconnects by itself when the engine restarts),
subscribes to every topic, decodes each message (``protocol/kv_events_wire.py``)
and hands the batch to the node's :class:`~kvgate.gateway.kv_ingest.NodeKvIngest`,
whose index operations ``apply`` performs on the controller, on the loop thread. A
message that does not decode is counted (``malformed``) and skipped: one bad batch
never stops the stream. The socket is closed when the task is cancelled (node
removed, gateway stopping).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.gateway.kv_ingest import IndexOp, NodeKvIngest
from kvgate.protocol.errors import KvEventWireError
from kvgate.protocol.kv_events_wire import decode_frames

__all__ = ["RCV_HWM", "follow_kv_events"]

log = logging.getLogger("kvgate.gateway.kv_events")

# messages ZMQ queues for us before it drops (the PUB side drops too, at its own mark):
# a stalled loop loses batches (counted as missed) instead of growing without bound
RCV_HWM = 10_000


async def follow_kv_events(
    endpoint: str,
    ingest: NodeKvIngest,
    *,
    model: Callable[[], str | None],
    apply: Callable[[list[IndexOp]], None],
    current: Callable[[], bool],
    context: zmq.asyncio.Context | None = None,
    connected: asyncio.Event | None = None,
) -> None:
    """Read ``endpoint`` until cancelled or ``current()`` turns false (node removed).

    ``model()`` is the node's base model (the root of its sequences), None while
    unknown: batches are then counted (``no_model``) and skipped. ``connected`` is set
    once the connection to the publisher is up (its handshake done, so the
    subscription is on its way): a PUB socket drops what it publishes before that (ZMQ's
    slow joiner), so the gateway waits for it before it serves.
    """
    ctx = context or zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    monitor: asyncio.Task[None] | None = None
    mon: zmq.asyncio.Socket | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # the monitor is on before the connect, or its handshake event could be missed
        up = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
        mon = sock.get_monitor_socket(up | zmq.EVENT_DISCONNECTED)
        monitor = asyncio.ensure_future(_watch_connection(mon, up, endpoint, connected))
        sock.connect(endpoint)
        while True:
            frames = await sock.recv_multipart(copy=True)
            if not current():
                return
            try:
                _topic, seq, batch = decode_frames(frames)
            except KvEventWireError as exc:
                if not ingest.counts["malformed"]:
                    log.warning("KV events from %s: %s (counted, skipped)", endpoint, exc)
                ingest.counts["malformed"] += 1
                continue
            name = model()
            if name is None:
                ingest.counts["no_model"] += 1
                continue
            apply(ingest.feed(seq, batch, name))  # even none: apply looks at the counts
    finally:
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        if mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)


async def _watch_connection(
    mon: zmq.asyncio.Socket, up: int, endpoint: str, connected: asyncio.Event | None
) -> None:
    """Log the publisher's connection coming and going (``mon``: the SUB socket's
    monitor); set ``connected`` when up."""
    while True:
        event = parse_monitor_message(await mon.recv_multipart())["event"]
        if event == up:
            log.info("KV events: connected to %s", endpoint)
            if connected is not None:
                connected.set()
        elif event == zmq.EVENT_DISCONNECTED:
            log.warning("KV events: %s disconnected; reconnecting", endpoint)
