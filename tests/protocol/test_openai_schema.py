"""OpenAI request validation, body edits and error bodies."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import (
    BatchedPromptError,
    InvalidJSONError,
    InvalidTypeError,
    InvalidValueError,
    MissingParameterError,
    ProtocolError,
    RequestTooLargeError,
    UnsupportedContentError,
    UnsupportedParameterError,
    authentication_error_body,
    error_body,
    invalid_request_body,
    not_found_body,
    overloaded_body,
    rate_limit_body,
    server_error_body,
)
from kvgate.protocol.openai_schema import (
    REMOVE,
    parse_chat_request,
    parse_completion_request,
    with_fields,
)


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _chat(**fields: Any) -> bytes:
    return _body(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _completion(**fields: Any) -> bytes:
    return _body(**{"model": "m", "prompt": "hello", **fields})


def test_completion_string_prompt_and_fields() -> None:
    req = parse_completion_request(
        _completion(max_tokens=16, stream=True, stream_options={"include_usage": True},
                    temperature=0, top_p=1, n=1, priority=-3, user="u", stop="\n",
                    cache_salt="s"), max_body_bytes=1024)
    assert req.model == "m" and req.prompt_text == "hello" and req.prompt_token_ids is None
    assert (req.max_tokens, req.stream, req.include_usage) == (16, True, True)
    assert (req.temperature, req.top_p, req.n, req.priority) == (0.0, 1.0, 1, -3)
    assert (req.user, req.stop, req.cache_salt) == ("u", ("\n",), "s")
    assert req.raw["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("prompt", "text", "tokens"), [
    ("abc", "abc", None),
    ("", "", None),
    (["abc"], "abc", None),
    ([1, 2, 3], None, (1, 2, 3)),
    ([[4, 5]], None, (4, 5)),
])
def test_completion_prompt_forms(prompt: Any, text: str | None,
                                 tokens: tuple[int, ...] | None) -> None:
    req = parse_completion_request(_completion(prompt=prompt))
    assert (req.prompt_text, req.prompt_token_ids) == (text, tokens)
    assert (req.max_tokens, req.stream, req.include_usage, req.stop) == (None, False, False, ())


def test_chat_messages_and_parts() -> None:
    req = parse_chat_request(_body(
        model="m", max_completion_tokens=5, max_tokens=99, stop=["a", "b"], stream=False,
        messages=[
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "one"},
                                         {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
            {"role": "tool", "content": "42", "tool_call_id": "t"},
            {"role": "developer", "content": []},
            # OpenAI's legacy role, Llama 3.1's tool role (vLLM takes any), a refusal
            {"role": "function", "name": "f", "content": "7"},
            {"role": "ipython", "content": "8"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ]))
    assert req.messages == (("system", "be nice"), ("user", "one\ntwo"), ("assistant", ""),
                            ("tool", "42"), ("developer", ""), ("function", "7"),
                            ("ipython", "8"), ("assistant", "no"))
    assert req.max_tokens == 5 and req.stop == ("a", "b") and not req.stream


Parser = Callable[[bytes], Any]
C, P = parse_chat_request, parse_completion_request
MALFORMED: list[tuple[Parser, bytes, type[ProtocolError], str | None]] = [
    (C, b"{not json", InvalidJSONError, None),
    (C, b"\xff\xfe", InvalidJSONError, None),
    (C, b'{"model": NaN}', InvalidJSONError, None),
    (C, b"[1, 2]", InvalidJSONError, None),
    (C, _body(messages=[{"role": "user", "content": "x"}]), MissingParameterError, "model"),
    (C, _chat(model=3), InvalidTypeError, "model"),
    (C, _chat(model=""), InvalidValueError, "model"),
    (C, _body(model="m"), MissingParameterError, "messages"),
    (C, _chat(messages={"role": "user"}), InvalidTypeError, "messages"),
    (C, _chat(messages=[]), InvalidValueError, "messages"),
    (C, _chat(messages=["hi"]), InvalidTypeError, "messages[0]"),
    (C, _chat(messages=[{"content": "x"}]), MissingParameterError, "messages[0].role"),
    (C, _chat(messages=[{"role": "", "content": "x"}]), InvalidValueError,
     "messages[0].role"),
    (C, _chat(messages=[{"role": 1, "content": "x"}]), InvalidTypeError, "messages[0].role"),
    (C, _chat(messages=[{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}]),
     MissingParameterError, "messages[0].content[0].refusal"),
    (C, _chat(messages=[{"role": "user"}]), MissingParameterError, "messages[0].content"),
    (C, _chat(messages=[{"role": "user", "content": 5}]), InvalidTypeError,
     "messages[0].content"),
    (C, _chat(messages=[{"role": "user", "content": "a"},
                        {"role": "user", "content": [{"type": "hologram", "hologram": {}}]}]),
     UnsupportedContentError, "messages[1].content[0].type"),
    (C, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     MissingParameterError, "messages[0].content[0].image_url"),
    (C, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]),
     InvalidTypeError, "messages[0].content[0].image_url"),
    (C, _chat(messages=[{"role": "user", "content": [{"text": "x"}]}]), MissingParameterError,
     "messages[0].content[0].type"),
    (C, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     InvalidTypeError, "messages[0].content[0].text"),
    (C, _chat(messages=[{"role": "user", "content": ["x"]}]), InvalidTypeError,
     "messages[0].content[0]"),
    (C, _chat(max_tokens="10"), InvalidTypeError, "max_tokens"),
    (C, _chat(max_tokens=0), InvalidValueError, "max_tokens"),
    (C, _chat(max_tokens=True), InvalidTypeError, "max_tokens"),
    (C, _chat(max_completion_tokens=-1), InvalidValueError, "max_completion_tokens"),
    (C, _chat(max_tokens=1.5), InvalidTypeError, "max_tokens"),
    (C, _chat(stream="yes"), InvalidTypeError, "stream"),
    (C, _chat(stream_options={"include_usage": True}), InvalidValueError, "stream_options"),
    (C, _chat(stream=True, stream_options=[]), InvalidTypeError, "stream_options"),
    (C, _chat(stream=True, stream_options={"include_usage": 1}), InvalidTypeError,
     "stream_options.include_usage"),
    (C, _chat(temperature=2.5), InvalidValueError, "temperature"),
    (C, _chat(temperature=-0.1), InvalidValueError, "temperature"),
    (C, _chat(temperature="hot"), InvalidTypeError, "temperature"),
    (C, _chat(top_p=0), InvalidValueError, "top_p"),
    (C, _chat(top_p=1.01), InvalidValueError, "top_p"),
    (C, _chat(n=2), UnsupportedParameterError, "n"),
    (C, _chat(n=0), InvalidValueError, "n"),
    (C, _chat(priority="high"), InvalidTypeError, "priority"),
    (C, _chat(user=7), InvalidTypeError, "user"),
    (C, _chat(stop=5), InvalidTypeError, "stop"),
    (C, _chat(stop=["a", 5]), InvalidTypeError, "stop[1]"),
    (C, _chat(cache_salt=1), InvalidTypeError, "cache_salt"),
    (C, _chat(cache_salt=""), InvalidValueError, "cache_salt"),  # vLLM refuses it too
    # an integer too large for a float is out of range, not a server error
    (C, b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":1'
        + b"0" * 400 + b"}", InvalidValueError, "temperature"),
    (C, b'{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":-1'
        + b"0" * 400 + b"}", InvalidValueError, "top_p"),
    (P, _body(model="m"), MissingParameterError, "prompt"),
    (P, _completion(prompt=5), InvalidTypeError, "prompt"),
    (P, _completion(prompt=[]), InvalidValueError, "prompt"),
    (P, _completion(prompt=["a", "b"]), BatchedPromptError, "prompt"),
    (P, _completion(prompt=[[1], [2]]), BatchedPromptError, "prompt"),
    (P, _completion(prompt=[1, "a"]), InvalidTypeError, "prompt[1]"),
    (P, _completion(prompt=[[]]), InvalidValueError, "prompt"),
    (P, _completion(prompt=[[1, -2]]), InvalidValueError, "prompt[0][1]"),
    (P, _completion(prompt=[1, -2]), InvalidValueError, "prompt[1]"),
    (P, _completion(prompt=[2**32]), InvalidValueError, "prompt[0]"),
    (P, _completion(prompt=[10**20]), InvalidValueError, "prompt[0]"),
    (P, _completion(prompt=[[1, "x"]]), InvalidTypeError, "prompt[0][1]"),
    (P, _completion(prompt=[{"x": 1}]), InvalidTypeError, "prompt[0]"),
    (P, _completion(prompt=[True]), InvalidTypeError, "prompt[0]"),
    (P, _completion(prompt=[1, 2, 3.0]), InvalidTypeError, "prompt[2]"),
    (P, _completion(prompt=[[5, 2**32 + 1]]), InvalidValueError, "prompt[0][1]"),
]


@pytest.mark.parametrize(("parse", "body", "error", "param"), MALFORMED,
                         ids=[f"{i}-{m[3]}" for i, m in enumerate(MALFORMED)])
def test_malformed_bodies(parse: Parser, body: bytes, error: type[ProtocolError],
                          param: str | None) -> None:
    with pytest.raises(error) as info:
        parse(body)
    exc = info.value
    assert type(exc) is error
    assert exc.param == param
    assert exc.http_status == 400
    body_out = exc.body()
    assert set(body_out["error"]) == {"message", "type", "param", "code"}
    assert body_out["error"]["type"] == "invalid_request_error"
    assert body_out["error"]["param"] == param
    assert body_out["error"]["message"] == exc.message == str(exc)


def test_media_parts_pass_as_markers_of_their_content() -> None:
    """An image (audio, a file) is a real engine's to read: the gateway accepts it, and
    it stands in the routing text as a marker of its content, so the same image keys the
    same prefix and another image does not."""

    def chat(url: str) -> Any:
        return parse_chat_request(_chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}}]}]))

    a, again, b = chat("http://x/cat.png"), chat("http://x/cat.png"), chat("http://x/dog.png")
    assert a.media == ("messages[0].content[1].image_url",)
    assert a.messages == again.messages != b.messages
    assert a.messages[0][1].startswith("what is this?\n\x00image_url:")
    audio = parse_chat_request(_chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]))
    assert audio.media == ("messages[0].content[0].input_audio",)
    assert parse_chat_request(_chat()).media == ()


def test_token_id_prompts_are_checked_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid ids (millions in a 16 MB body) are checked without a Python call per id,
    which held the event loop for seconds; a bad id is still named."""
    from kvgate.protocol import openai_schema

    calls = 0
    real = openai_schema._is_int

    def counting(value: object) -> bool:
        nonlocal calls
        calls += 1
        return real(value)

    monkeypatch.setattr(openai_schema, "_is_int", counting)
    ids = list(range(5000))
    req = parse_completion_request(_completion(prompt=ids))
    assert req.prompt_token_ids == tuple(ids)
    assert calls < 10  # the prompt's first element, not every id
    with pytest.raises(InvalidValueError) as info:
        parse_completion_request(_completion(prompt=[*ids, -1]))
    assert info.value.param == "prompt[5000]"


def test_body_size_limit() -> None:
    body = _completion(prompt="x" * 100)
    with pytest.raises(RequestTooLargeError) as info:
        parse_completion_request(body, max_body_bytes=50)
    assert info.value.http_status == 413
    assert parse_completion_request(body, max_body_bytes=len(body)).prompt_text == "x" * 100


def test_openai_messages_look_like_openai() -> None:
    with pytest.raises(InvalidTypeError) as info:
        parse_chat_request(_chat(max_tokens="10"))
    assert info.value.message == (
        "Invalid type for 'max_tokens': expected an integer, but got a string instead.")
    assert info.value.code == "invalid_type"
    with pytest.raises(InvalidValueError) as info2:
        parse_chat_request(_chat(temperature=3))
    assert info2.value.message == ("Invalid 'temperature': decimal above maximum value. "
                                   "Expected a value <= 2, but got 3 instead.")
    with pytest.raises(MissingParameterError) as info3:
        parse_chat_request(_body(model="m"))
    assert info3.value.message == "Missing required parameter: 'messages'."


@settings(max_examples=100, deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "messages", "role", "content", "type", "text", "prompt",
                         "stream", "stream_options", "include_usage", "n", "stop",
                         "temperature", "top_p", "max_tokens", "cache_salt", "image_url"]),
        inner, max_size=4),
    max_leaves=12))
def test_any_json_raises_only_protocol_errors(value: Any) -> None:
    body = json.dumps(value).encode()
    for parse in (parse_chat_request, parse_completion_request):
        with contextlib.suppress(ProtocolError):
            parse(body)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=40))
def test_any_bytes_raise_only_protocol_errors(body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_chat_request(body)


def test_with_fields_edits_and_keeps_the_rest() -> None:
    raw_body = ('{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true},'
                '"messages":[{"role":"user","content":"héllo"}],"vllm_xargs":{"a":1}}')
    req = parse_chat_request(raw_body.encode())
    out = json.loads(with_fields(req.raw, stream_options={"include_usage": True}, priority=2,
                                 vllm_xargs=REMOVE))
    assert list(out) == ["model", "stream", "stream_options", "messages", "priority"]
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert out["priority"] == 2 and out["messages"][0]["content"] == "héllo"
    assert "vllm_xargs" in req.raw and "include_usage" not in req.raw["stream_options"]
    assert "héllo".encode() in with_fields(req.raw)
    assert parse_chat_request(with_fields(req.raw, stream_options={"include_usage": True})
                              ).include_usage
    assert json.loads(with_fields({"model": "m"}, stream_options={"include_usage": True})) == {
        "model": "m", "stream_options": {"include_usage": True}}


def test_error_bodies() -> None:
    assert error_body("boom", "server_error", None, None) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert invalid_request_body("bad", "x")["error"]["type"] == "invalid_request_error"
    auth = authentication_error_body()["error"]
    assert (auth["type"], auth["code"]) == ("invalid_request_error", "invalid_api_key")
    limited = rate_limit_body()["error"]
    assert (limited["type"], limited["code"]) == ("requests", "rate_limit_exceeded")
    assert rate_limit_body(kind="tokens")["error"]["type"] == "tokens"
    missing = not_found_body("llama")["error"]
    assert missing["code"] == "model_not_found" and "`llama`" in missing["message"]
    assert not_found_body()["error"]["code"] is None
    assert overloaded_body()["error"]["type"] == "server_error"
    assert overloaded_body(code="pool_overloaded")["error"]["code"] == "pool_overloaded"
    assert server_error_body("x")["error"]["message"] == "x"
    err = ProtocolError("m", param="p")
    assert isinstance(err, ValueError) and err.http_status == 400 and err.param == "p"
    assert "param='p'" in repr(err)


def test_edit_body_splices_absent_keys_and_matches_with_fields() -> None:
    from kvgate.protocol import edit_body

    body = b'{"model":"m","prompt":"h\\u00e9llo \\"x\\"","stream":true} \n'
    req = parse_completion_request(body)
    out = edit_body(body, req.raw, {"priority": 3, "stream_options": {"include_usage": True}})
    assert out.startswith(b'{"model":"m","prompt":"h\\u00e9llo \\"x\\"","stream":true,')
    assert json.loads(out) == json.loads(
        with_fields(req.raw, priority=3, stream_options={"include_usage": True}))
    assert edit_body(b" {  } ", {}, {"a": 1}) == b' {  "a":1} '
    assert edit_body(body, req.raw, {}) is body
    # present keys (a merge, a replacement) and REMOVE fall back to re-serialising
    merged = b'{"model":"m","prompt":"p","stream":true,"stream_options":{"x":1},"priority":1}'
    r2 = parse_completion_request(merged).raw
    got = json.loads(edit_body(merged, r2, {"stream_options": {"include_usage": True},
                                            "priority": 2, "model": REMOVE}))
    assert got == {"prompt": "p", "stream": True, "priority": 2,
                   "stream_options": {"x": 1, "include_usage": True}}
    # integers past 64 bits stay exact integers (orjson would read them as floats)
    big = b'{"model":"m","prompt":"p","seed":123456789012345678901234567890,"priority":1}'
    r3 = parse_completion_request(big)
    assert b"123456789012345678901234567890" in edit_body(big, r3.raw, {"priority": 5})
    big_prio = b'{"model":"m","prompt":"p","priority":123456789012345678901234567890}'
    assert parse_completion_request(big_prio).priority == 123456789012345678901234567890
    with pytest.raises(InvalidTypeError):
        parse_completion_request(b'{"model":"m","prompt":"p","max_tokens":1e30}')
    # a token id past 64 bits is read exactly, and refused for what it is (ids are
    # unsigned 32-bit ints), not for a float
    tokens = b'{"model":"m","prompt":[123456789012345678901234567890, 1]}'
    with pytest.raises(InvalidValueError, match="123456789012345678901234567890") as exc:
        parse_completion_request(tokens)
    assert exc.value.param == "prompt[0]"
    # UTF-16 bodies (json detects the encoding) are never spliced into
    utf16 = json.dumps({"model": "m", "prompt": "p"}).encode("utf-16")
    r4 = parse_completion_request(utf16)
    assert json.loads(edit_body(utf16, r4.raw, {"priority": 1}))["priority"] == 1


@pytest.mark.parametrize(("raw", "param"), [
    (b'"temperature":1e309', "temperature"),
    (b'"temperature":-1e309', "temperature"),
    (b'"top_p":1e400', "top_p"),
])
def test_infinite_numbers_are_not_finite_rather_than_below_minimum(raw: bytes,
                                                                  param: str) -> None:
    # JSON text like 1e309 parses to inf: the message must say so, not "below minimum"
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],' + raw + b"}"
    with pytest.raises(InvalidValueError) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert info.value.code == "invalid_value"
    assert info.value.message == f"Invalid '{param}': must be a finite number."
