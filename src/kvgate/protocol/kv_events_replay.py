"""vLLM's KV-event replay protocol (the ROUTER socket), as pure frame builders and parsers.

The client sends ``[b"", start_seq]`` from a DEALER socket (the ROUTER sees
``[identity, b"", start_seq]``). The server answers with every buffered batch
whose seq is >= ``start_seq``, oldest first, then an end marker whose seq is
``-1`` as 8 signed bytes (eight ``0xff``). Two reply framings exist:

* vLLM <= 0.25.1: ``[identity, b"", seq, payload]``; end ``[identity, b"", END, b""]``;
* vLLM >= 0.26.0: ``[identity, b"", topic, seq, payload]``;
  end ``[identity, b"", b"", END, b""]``.

The DEALER receives the same frames without ``identity``. This module only
builds and parses those frame lists; the sockets live in the gateway and the
engine server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.protocol.errors import KvEventWireError
from kvgate.protocol.kv_events_wire import (
    LATEST_VLLM_VERSION,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_seq,
    schema_for,
)

__all__ = [
    "END_SEQ",
    "ReplayBatch",
    "ReplayEnd",
    "build_replay_end",
    "build_replay_reply",
    "build_replay_request",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_has_topic_frame",
]

#: ``(-1).to_bytes(8, "big", signed=True)``: the seq of the end marker.
END_SEQ = b"\xff" * 8


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayBatch:
    """One replayed batch. ``topic`` is ``None`` in the old framing (no topic frame)."""

    seq: int
    batch: KVEventBatch
    topic: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayEnd:
    """The end marker: no more replies for this request."""

    topic_frame: bool


def replay_has_topic_frame(vllm_version: str = LATEST_VLLM_VERSION) -> bool:
    """Whether ``vllm_version``'s replay replies carry a topic frame (>= 0.26.0)."""
    return schema_for(vllm_version).replay_topic_frame


def build_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends: ``[b"", start_seq as 8 bytes big-endian]``."""
    return [b"", encode_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """What the ROUTER receives, ``[identity, b"", start_seq]`` -> ``(identity, start_seq)``."""
    if len(frames) != 3:
        raise KvEventWireError(f"replay request needs 3 frames, got {len(frames)}",
                               param="frames")
    identity, delimiter, seq = (bytes(f) for f in frames)
    if delimiter:
        raise KvEventWireError("replay request frame 1 must be empty", param="frames")
    return identity, decode_seq(seq)


def build_replay_reply(identity: bytes, topic: str, seq: int, payload: bytes, *,
                       topic_frame: bool = True) -> list[bytes]:
    """What the ROUTER sends for one buffered batch (``payload`` is the encoded batch).

    ``seq`` 2**64-1 is reserved: its bytes are the end marker's.
    """
    if encode_seq(seq) == END_SEQ:
        raise KvEventWireError("seq 2**64-1 is reserved for the end marker", param="seq")
    head = [identity, b""]
    if topic_frame:
        head.append(topic.encode("utf-8"))
    return [*head, encode_seq(seq), payload]


def build_replay_end(identity: bytes, *, topic_frame: bool = True) -> list[bytes]:
    """The end marker the ROUTER sends after the last batch (the topic frame, if any, is empty)."""
    head = [identity, b""]
    if topic_frame:
        head.append(b"")
    return [*head, END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes], *,
                       delimiter: bool = True) -> ReplayBatch | ReplayEnd:
    """Parse one reply as the DEALER receives it, in either framing.

    With ``delimiter`` (a DEALER socket) the first frame must be empty and is
    dropped. What remains is ``[seq, payload]`` (old) or ``[topic, seq, payload]``
    (new). A seq of eight ``0xff`` or an empty payload is the end marker.
    """
    rest = [bytes(f) for f in frames]
    if delimiter:
        if not rest or rest[0]:
            raise KvEventWireError("replay reply must start with an empty frame",
                                   param="frames")
        rest = rest[1:]
    if len(rest) not in (2, 3):
        raise KvEventWireError(f"replay reply needs 2 or 3 frames after the delimiter, "
                               f"got {len(rest)}", param="frames")
    has_topic = len(rest) == 3
    seq_frame, payload = rest[-2], rest[-1]
    if len(seq_frame) != 8:
        raise KvEventWireError(f"seq frame must be 8 bytes, got {len(seq_frame)}", param="seq")
    if seq_frame == END_SEQ or not payload:
        return ReplayEnd(topic_frame=has_topic)
    topic: str | None = None
    if has_topic:
        try:
            topic = rest[0].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KvEventWireError("topic frame is not UTF-8", param="topic") from exc
    return ReplayBatch(seq=decode_seq(seq_frame), batch=decode_batch(payload), topic=topic)
