"""The incremental SSE parser and the OpenAI stream helpers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import SSEError
from kvgate.protocol.sse import (
    DONE_EVENT,
    SSEEvent,
    SSEParser,
    Usage,
    cached_tokens,
    encode_event,
    encode_json_event,
    error_event,
    is_error_chunk,
    is_usage_only_chunk,
    parse_usage,
)

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
         "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
USAGE = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [],
         "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                   "prompt_tokens_details": {"cached_tokens": 32}}}
VLLM_STREAM = (encode_json_event(CHUNK) + encode_json_event(USAGE) + DONE_EVENT)
MIXED = (
    b"\xef\xbb\xbf: keep-alive\n\n"
    b"event: message\r\nid: 7\r\ndata: first\r\ndata:  second\r\n\r\n"
    b"data\n\n"
    b": a comment inside\ndata: x\rretry: 1500\r\r"
    b"retry: nope\nid: bad\0id\nfield-without-colon\ndata: {\"a\": 1}\n\n"
    b"event: only-event\n\n"
    b"data: [DONE]\n\n"
)


def _feed_in_pieces(stream: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    last = 0
    for cut in [*sorted(cuts), len(stream)]:
        events += parser.feed(stream[last:cut])
        last = cut
    return events + parser.close()


def _one_chunk(stream: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    return parser.feed(stream) + parser.close()


def _byte_by_byte(stream: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for i in range(len(stream)):
        events += parser.feed(stream[i:i + 1])
    return events + parser.close()


def test_vllm_stream() -> None:
    events = _one_chunk(VLLM_STREAM)
    assert [e.json() for e in events] == [CHUNK, USAGE, None]
    assert events[-1].is_done and not events[0].is_done
    assert b"".join(e.raw for e in events) == VLLM_STREAM
    assert _byte_by_byte(VLLM_STREAM) == events
    crlf = VLLM_STREAM.replace(b"\n", b"\r\n")
    crlf_events = _byte_by_byte(crlf)
    assert [e.data for e in crlf_events] == [e.data for e in events]
    assert b"".join(e.raw for e in crlf_events) == crlf
    assert _one_chunk(crlf) == crlf_events


def test_mixed_stream_fields_and_separators() -> None:
    events = _one_chunk(MIXED)
    assert [(e.data, e.event, e.id, e.retry) for e in events] == [
        ("first\n second", "message", "7", None),
        ("", None, "7", None),
        ("x", None, "7", 1500),
        ('{"a": 1}', None, "7", None),
        ("[DONE]", None, "7", None),
    ]
    assert events[0].raw == b"event: message\r\nid: 7\r\ndata: first\r\ndata:  second\r\n\r\n"
    assert events[2].raw == b": a comment inside\ndata: x\rretry: 1500\r\r"
    assert events[3].json() == {"a": 1}
    assert events[1].json() is None
    assert _byte_by_byte(MIXED) == events


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(MIXED)), max_size=12),
       stream=st.sampled_from([MIXED, VLLM_STREAM, VLLM_STREAM.replace(b"\n", b"\r\n"),
                               VLLM_STREAM.replace(b"\n", b"\r")]))
def test_any_chunking_gives_the_same_events(cuts: list[int], stream: bytes) -> None:
    assert _feed_in_pieces(stream, [c for c in cuts if c <= len(stream)]) == _one_chunk(stream)


@settings(max_examples=100, deadline=None)
@given(lines=st.lists(st.text(alphabet=st.characters(exclude_categories=["Cs"]),
                              max_size=20), min_size=1, max_size=4))
def test_encode_event_round_trip(lines: list[str]) -> None:
    data = "\n".join(line.replace("\r", "").replace("\n", "") for line in lines)
    raw = encode_event(data)
    (event,) = _byte_by_byte(raw)
    assert event.data == data and event.raw == raw
    assert encode_event(data.encode()) == raw


def test_unterminated_and_trailing_cr() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\n") == [SSEEvent(data="a", raw=b"data: a\n\n")]
    assert parser.close() == []  # an event without its blank line is dropped
    parser = SSEParser()
    assert parser.feed(b"data: c\r\r") == []  # the final \r might start a \r\n
    assert parser.close() == [SSEEvent(data="c", raw=b"data: c\r\r")]
    parser = SSEParser()
    assert parser.feed(b"data: d\r\n\r") == []
    assert parser.feed(b"\n") == [SSEEvent(data="d", raw=b"data: d\r\n\r\n")]


def test_bom_split_and_invalid_utf8() -> None:
    assert _byte_by_byte(b"\xef\xbb\xbfdata: x\n\n") == [SSEEvent(data="x", raw=b"data: x\n\n")]
    (event,) = _one_chunk(b"data: \xff\n\n")
    assert event.data == "\ufffd"


def test_event_size_limit() -> None:
    parser = SSEParser(max_event_bytes=16)
    parser.feed(b"data: 0123456789")
    with pytest.raises(SSEError) as info:
        parser.feed(b"abcdef")
    assert info.value.param == "stream"
    small = SSEParser(max_event_bytes=16)
    for _ in range(10):  # completed events do not accumulate
        assert len(small.feed(b"data: 0123456\n\n")) == 1


def test_usage_helpers() -> None:
    assert is_usage_only_chunk(USAGE) and not is_usage_only_chunk(CHUNK)
    assert not is_usage_only_chunk({"choices": [], "usage": None})
    assert cached_tokens(USAGE) == 32
    assert parse_usage(USAGE) == Usage(prompt_tokens=40, completion_tokens=2, total_tokens=42,
                                       cached_tokens=32)
    response = {"object": "chat.completion", "choices": [{"message": {"content": "x"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                          "prompt_tokens_details": None}}
    assert cached_tokens(response) is None
    assert parse_usage(response) == Usage(prompt_tokens=5, completion_tokens=1,
                                          total_tokens=6, cached_tokens=None)
    assert parse_usage(CHUNK) is None and cached_tokens(CHUNK) is None
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None


def test_error_event() -> None:
    raw = error_event("upstream died", "server_error", 502)
    first, done = _one_chunk(raw)
    payload = first.json()
    assert payload == {"error": {"message": "upstream died", "type": "server_error",
                                 "param": None, "code": 502}}
    assert is_error_chunk(payload) and not is_error_chunk(CHUNK)
    assert is_error_chunk({"object": "error", "message": "x"})
    assert done.is_done and raw.endswith(DONE_EVENT)
    assert json.loads(raw[len(b"data: "):raw.index(b"\n")]) == payload


def test_encode_event_splits_lines() -> None:
    assert encode_event("a\nb") == b"data: a\ndata: b\n\n"
    assert encode_event("a\r\nb", event="e") == b"event: e\ndata: a\ndata: b\n\n"
    assert encode_event(b"[DONE]") == DONE_EVENT


def test_usage_of_body() -> None:
    from kvgate.protocol import usage_of_body

    def cached(body: bytes) -> int | None:
        usage = usage_of_body(body)
        return None if usage is None else usage.cached_tokens

    body = b'{"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}'
    assert cached(body) == 4
    # vLLM and SGLang leave the details out when nothing was cached: a usage all the same
    no_details = usage_of_body(b'{"usage":{"prompt_tokens":9}}')
    assert no_details is not None and no_details.cached_tokens is None
    assert no_details.prompt_tokens == 9
    assert cached(b'{"usage":{"prompt_tokens_details":{"cached\\u005ftokens":2}}}') == 2
    assert usage_of_body(b'{"\\u0075sage":{"prompt_tokens":1}}') is not None
    assert usage_of_body(b"[1]") is None
    assert usage_of_body(b'{"choices":[]}') is None
    assert usage_of_body(b"not json usage") is None
