"""Server-sent events as OpenAI-compatible servers stream them.

:class:`SSEParser` is an incremental parser (HTML Living Standard event-stream
rules): lines end in ``\\r\\n``, ``\\n`` or ``\\r``; a blank line dispatches the
event; ``data:`` lines are joined with ``\\n``; lines starting with ``:`` are
comments. It gives the same events however the bytes are split into chunks.
Each event keeps the exact bytes it was made of (``raw``), so a proxy can
forward or drop events one by one.

The helpers read what a gateway needs from OpenAI chunks: whether a chunk is the
usage-only chunk that ``stream_options.include_usage`` adds (``choices: []`` and
``usage``), the ``usage`` numbers including
``usage.prompt_tokens_details.cached_tokens`` (the engine's own count of
prefix-cache hits), and an in-stream error event.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

try:  # fast path; the stdlib json decides whatever orjson refuses
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    _orjson = None  # type: ignore[assignment]

from kvgate.protocol.errors import SSEError, error_body

__all__ = [
    "DONE",
    "DONE_EVENT",
    "SSEEvent",
    "SSEParser",
    "Usage",
    "cached_tokens",
    "encode_event",
    "error_event",
    "is_error_chunk",
    "is_usage_only_chunk",
    "parse_usage",
    "usage_of_body",
]

DONE: Final = "[DONE]"
DONE_EVENT: Final = b"data: [DONE]\n\n"
DEFAULT_MAX_EVENT_BYTES: Final = 8 * 1024 * 1024
_BOM: Final = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True, kw_only=True)
class SSEEvent:
    """One dispatched event. ``data`` is the ``data:`` lines joined with ``\\n``.

    ``comment`` marks a block with no data but a comment line (``: keep-alive``),
    which only a parser made with ``comments=True`` dispatches."""

    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None
    raw: bytes = b""
    comment: bool = False

    @property
    def is_done(self) -> bool:
        return self.data == DONE

    def json(self) -> dict[str, Any] | None:
        """The data as a JSON object, or ``None`` for ``[DONE]``, non-JSON or non-objects."""
        if self.is_done:
            return None
        return _json_object(self.data)


class SSEParser:
    """Feed it bytes as they arrive; it returns the events completed so far.

    ``raw`` of an event is every byte since the previous blank line up to and
    including its own terminating blank line (comments and ``id:`` lines in the
    same block included). Blocks without data (keep-alive comments) dispatch
    nothing, as the standard says; with ``comments=True`` a block without data that
    holds a comment line is dispatched as an event with ``comment=True`` and empty
    ``data`` (a proxy forwards it, a client would ignore it).
    """

    __slots__ = ("_buf", "_comment", "_comments", "_data", "_event", "_event_start", "_id",
                 "_line_start", "_max", "_retry", "_scan", "_started")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 comments: bool = False) -> None:
        self._max = max_event_bytes
        self._comments = comments
        self._comment = False  # the current block has a comment line
        self._buf = bytearray()
        self._line_start = 0  # start of the next unprocessed line in _buf
        self._scan = 0  # where to resume looking for a line terminator
        self._event_start = 0  # start of the current block's raw bytes in _buf
        self._started = False
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf
        buf += chunk
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(bytes(buf)):
                return []
            self._started = True
            if buf.startswith(_BOM):
                del buf[: len(_BOM)]
        events: list[SSEEvent] = []
        while True:
            end, after = self._find_eol(buf, max(self._line_start, self._scan))
            if end < 0:
                break
            line = bytes(buf[self._line_start:end])
            self._line_start = self._scan = after
            if not line:
                event = self._dispatch(bytes(buf[self._event_start:after]))
                self._event_start = after
                if event is not None:
                    events.append(event)
            else:
                self._field(line)
        self._scan = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        cut = self._event_start
        if cut:
            del buf[:cut]
            self._line_start -= cut
            self._scan -= cut
            self._event_start = 0
        if len(buf) > self._max:
            raise SSEError(f"SSE event larger than {self._max} bytes", param="stream")
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a trailing ``\\r`` completes its line; an unterminated event is
        dropped, as the standard says."""
        events: list[SSEEvent] = []
        buf = self._buf
        if buf.endswith(b"\r") and self._started:
            line = bytes(buf[self._line_start:-1])
            if not line:
                event = self._dispatch(bytes(buf[self._event_start:]))
                if event is not None:
                    events.append(event)
        buf.clear()
        self._line_start = self._scan = self._event_start = 0
        self._data, self._event, self._retry = [], None, None
        self._comment = False
        return events

    @staticmethod
    def _find_eol(buf: bytearray, start: int) -> tuple[int, int]:
        """(line end, next line start) of the first complete line at/after start, or (-1, -1).

        A ``\\r`` as the last byte is not yet a line end: a ``\\n`` may follow.
        """
        lf = buf.find(b"\n", start)
        cr = buf.find(b"\r", start, lf if lf >= 0 else len(buf))
        if cr >= 0:
            if cr + 1 < len(buf):
                return cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            return -1, -1
        if lf >= 0:
            return lf, lf + 1
        return -1, -1

    def _dispatch(self, raw: bytes) -> SSEEvent | None:
        comment, self._comment = self._comment, False
        if not self._data:
            self._event = self._retry = None
            if comment and self._comments:
                return SSEEvent(data="", id=self._id, raw=raw, comment=True)
            return None
        event = SSEEvent(data="\n".join(self._data), event=self._event, id=self._id,
                         retry=self._retry, raw=raw)
        self._data, self._event, self._retry = [], None, None
        return event

    def _field(self, line: bytes) -> None:
        if line.startswith(b":"):
            self._comment = True
            return
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", errors="replace")
        if name == b"data":
            self._data.append(text)
        elif name == b"event":
            self._event = text
        elif name == b"id" and "\0" not in text:
            self._id = text
        elif name == b"retry" and text.isascii() and text.isdigit():
            self._retry = int(text)


def encode_event(data: bytes | str, *, event: str | None = None) -> bytes:
    """``data: ...\\n\\n`` (one ``data:`` line per line of ``data``)."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    head = b"event: " + event.encode("utf-8") + b"\n" if event is not None else b""
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def encode_json_event(obj: Mapping[str, Any]) -> bytes:
    """A ``data:`` event carrying compact JSON."""
    return encode_event(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def error_event(message: str, type: str = "server_error", code: str | int | None = None,
                param: str | None = None) -> bytes:
    """An OpenAI-shaped in-stream error, ``data: {"error": {...}}``, then ``data: [DONE]``."""
    return encode_json_event(error_body(message, type, param, code)) + DONE_EVENT


def is_error_chunk(obj: Mapping[str, Any]) -> bool:
    """A chunk that reports an error (``{"error": {...}}``, vLLM/OpenAI, or SGLang's
    top-level ``{"object": "error", ...}``)."""
    return isinstance(obj.get("error"), dict) or obj.get("object") == "error"


def error_status(obj: Mapping[str, Any]) -> int | None:
    """The HTTP status an error chunk states (vLLM's ``"code": 400`` in ``error``, or at
    the top level in its older ``{"object": "error", ...}``); None when it states none
    (OpenAI's own codes are names, such as ``"invalid_api_key"``)."""
    inner = obj.get("error")
    code = inner.get("code") if isinstance(inner, dict) else obj.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    return None


def is_usage_only_chunk(obj: Mapping[str, Any]) -> bool:
    """The final chunk ``include_usage`` adds: ``choices`` empty and ``usage`` present."""
    choices = obj.get("choices")
    return isinstance(choices, list) and not choices and isinstance(obj.get("usage"), dict)


def _count(mapping: Mapping[str, Any], key: str) -> int | None:
    value = mapping.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    cached_tokens: int | None


def parse_usage(obj: Mapping[str, Any]) -> Usage | None:
    """``usage`` of a chunk or of a non-streamed response, or ``None`` if it has none."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens=_count(usage, "prompt_tokens"),
                 completion_tokens=_count(usage, "completion_tokens"),
                 total_tokens=_count(usage, "total_tokens"), cached_tokens=cached)


def cached_tokens(obj: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM fills it only with
    ``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``, and both
    leave the details out when nothing was cached), or ``None``."""
    usage = parse_usage(obj)
    return usage.cached_tokens if usage is not None else None


def _json_object(data: str | bytes) -> dict[str, Any] | None:
    obj: Any = None
    parsed = False
    if _orjson is not None:
        try:
            obj = _orjson.loads(data)
            parsed = True
        except _orjson.JSONDecodeError:
            pass
    if not parsed:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def usage_of_body(body: bytes) -> Usage | None:
    """:func:`parse_usage` of a non-streamed JSON response body (``None`` when the body is
    not a JSON object or has no usage); skips parsing a body that cannot hold one."""
    if b"usage" not in body and b"\\u" not in body:  # (a key may be escaped)
        return None
    obj = _json_object(body)
    return parse_usage(obj) if obj is not None else None
