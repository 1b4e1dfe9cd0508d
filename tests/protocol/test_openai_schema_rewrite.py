"""Bodies the parser accepts can always be written back (with_fields / edit_body), and
numbers no engine accepts (JSON like 1e400, read as inf) are refused at parse time."""

from __future__ import annotations

import json

import pytest

from kvgate.protocol import (
    InvalidJSONError,
    InvalidValueError,
    edit_body,
    parse_chat_request,
    parse_completion_request,
    with_fields,
)

USAGE = {"stream_options": {"include_usage": True}}


def test_a_lone_surrogate_survives_a_rewrite_as_its_escape() -> None:
    # valid JSON (a \ud800 escape), not encodable as UTF-8: the rewrite raised
    # UnicodeEncodeError (a 500 at the gateway)
    body = b'{"model":"m","prompt":"hi \\ud800","stream":true,"stream_options":{}}'
    req = parse_completion_request(body)
    out = edit_body(body, req.raw, USAGE)
    assert b"\\ud800" in out
    back = json.loads(out)
    assert back["prompt"] == "hi \ud800"
    assert back["stream_options"] == {"include_usage": True}
    # the direct form too: other non-ASCII text stays UTF-8, as the client sent it
    out = with_fields({"p": "\udc00 é \U0001f600"}, priority=1)
    assert out == '{"p":"\\udc00 é \U0001f600","priority":1}'.encode()
    assert json.loads(out) == {"p": "\udc00 é \U0001f600", "priority": 1}


def test_a_chat_body_with_a_surrogate_and_a_priority_edit() -> None:
    body = b'{"model":"m","priority":2,"messages":[{"role":"user","content":"\\udc00"}]}'
    req = parse_chat_request(body)
    out = edit_body(body, req.raw, {"priority": 0})
    assert json.loads(out)["priority"] == 0
    assert json.loads(out)["messages"][0]["content"] == "\udc00"


@pytest.mark.parametrize(("field", "param"), [
    (b'"foo":1e400', "foo"),
    (b'"logit_bias":{"1":1e400}', "logit_bias.1"),
    (b'"x":[1,{"y":[0,-1e999]}]', "x[1].y[1]"),
    (b'"priority":2,"bar":1e999', "bar"),
    (b'"seed":123456789012345678901234567890,"z":1E309', "z"),  # the json-only path too
])
def test_numbers_that_read_as_infinite_are_refused_naming_the_field(field: bytes,
                                                                    param: str) -> None:
    body = b'{"model":"m","prompt":"x",' + field + b"}"
    with pytest.raises(InvalidValueError) as info:
        parse_completion_request(body)
    assert info.value.param == param
    assert info.value.code == "invalid_value"
    assert info.value.http_status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    chat = b'{"model":"m","messages":[{"role":"user","content":"x"}],' + field + b"}"
    with pytest.raises(InvalidValueError):
        parse_chat_request(chat)


def test_large_finite_numbers_and_nan_are_as_before() -> None:
    req = parse_completion_request(b'{"model":"m","prompt":"x","foo":1e308,"bar":-1.5e-400}')
    assert req.raw["foo"] == 1e308
    with pytest.raises(InvalidJSONError):  # not JSON at all: the parse error it was
        parse_completion_request(b'{"model":"m","prompt":"x","foo":NaN}')


def test_a_body_too_deep_to_write_back_is_a_400_not_a_crash() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"model":"m","prompt":"x","stream":true,"stream_options":{},"x":' + deep + b"}"
    try:
        req = parse_completion_request(body)
    except InvalidJSONError:
        return  # refused at parse time: as good
    with pytest.raises(InvalidJSONError) as info:
        edit_body(body, req.raw, USAGE)
    assert info.value.http_status == 400
    # a key the body lacks is spliced in, nothing is rewritten: that one passes
    plain = b'{"model":"m","prompt":"x","stream":true,"x":' + deep + b"}"
    req2 = parse_completion_request(plain)
    assert edit_body(plain, req2.raw, USAGE).endswith(b',"stream_options":{"include_usage":true}}')
