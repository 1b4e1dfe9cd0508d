"""SSEParser(comments=True): comment blocks (keep-alives) come out as events a proxy can
forward, with their exact bytes, however the stream is cut; the default is unchanged."""

from __future__ import annotations

from kvgate.protocol.sse import SSEEvent, SSEParser

STREAM = (
    b"\xef\xbb\xbf: keep-alive\n\n"
    b"data: one\n\n"
    b":ping\r\n:pong\r\n\r\n"
    b": inside a data block\ndata: two\n\n"
    b"event: no-data-no-comment\n\n"
    b": last\r\r"
    b"data: [DONE]\n\n"
)


def _events(stream: bytes, comments: bool, step: int) -> list[SSEEvent]:
    parser = SSEParser(comments=comments)
    events: list[SSEEvent] = []
    for i in range(0, len(stream), step):
        events += parser.feed(stream[i:i + step])
    return events + parser.close()


def test_comment_blocks_are_events_with_their_raw_bytes() -> None:
    for step in (1, 3, 7, len(STREAM)):
        events = _events(STREAM, True, step)
        kinds = [("comment" if e.comment else e.data) for e in events]
        assert kinds == ["comment", "one", "comment", "two", "comment", "[DONE]"], step
        assert [e.raw for e in events if e.comment] == [
            b": keep-alive\n\n", b":ping\r\n:pong\r\n\r\n", b": last\r\r"]
        assert all(e.data == "" and not e.is_done and e.json() is None
                   for e in events if e.comment)
        # a comment inside a data block stays part of that event
        assert events[3].raw == b": inside a data block\ndata: two\n\n"
        assert not events[3].comment


def test_the_default_parser_still_drops_comment_blocks() -> None:
    events = _events(STREAM, False, 1)
    assert [e.data for e in events] == ["one", "two", "[DONE]"]
    assert not any(e.comment for e in events)
