"""OpenAI-compatible request bodies: validation as vLLM's server does it, and small edits.

``parse_completion_request`` and ``parse_chat_request`` take the raw body bytes
and return a frozen value with the fields the gateway needs (model, prompt or
messages, token limit, streaming, sampling knobs, priority, cache salt) plus the
parsed JSON object as ``raw``, so the gateway can forward the body unchanged or
with a few fields edited (:func:`with_fields`). Bad input raises a
:class:`~kvgate.protocol.errors.ProtocolError` subclass whose ``param`` names
the offending field in OpenAI's path notation (``messages[2].content[0].type``)
and whose message follows OpenAI's wording. Nothing is hashed or tokenised here.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import xxhash

try:  # orjson is ~10x faster; the stdlib json is the fallback and the reference
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    _orjson = None  # type: ignore[assignment]

from kvgate.protocol.errors import (
    BatchedPromptError,
    InvalidJSONError,
    InvalidTypeError,
    InvalidValueError,
    MissingParameterError,
    RequestTooLargeError,
    UnsupportedContentError,
    UnsupportedParameterError,
    type_name,
)

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_MAX_BODY_BYTES",
    "REMOVE",
    "ChatRequest",
    "CompletionRequest",
    "edit_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_object",
    "with_fields",
]

DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# OpenAI's roles; any other non-empty role is passed on (vLLM's chat template judges it)
CHAT_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")
#: Content-part separator; vLLM joins text parts with a newline for string-format templates.
TEXT_PART_SEPARATOR: Final = "\n"
#: chat content parts that carry media (OpenAI's and vLLM's): accepted and passed on
MEDIA_PART_TYPES: Final = ("image_url", "input_audio", "audio_url", "video_url", "file",
                           "image_embeds")


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


#: Pass as a value to :func:`with_fields` to delete a key.
REMOVE: Final = _Remove()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Common:
    model: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    n: int
    priority: int | None
    user: str | None
    stop: tuple[str, ...]
    cache_salt: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest(_Common):
    """``POST /v1/completions``. Exactly one of ``prompt_text`` / ``prompt_token_ids`` is set."""

    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    raw: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest(_Common):
    """``POST /v1/chat/completions``. ``messages`` is ``((role, text), ...)``, a media
    part standing in its text as a marker; ``media`` names those parts' params."""

    messages: tuple[tuple[str, str], ...]
    media: tuple[str, ...] = ()
    raw: Mapping[str, Any]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _FloatReader:
    """``parse_float`` for the stdlib json: JSON like ``1e400`` reads as ``inf``, a
    number no engine accepts and no JSON writer writes back; remember that one did."""

    __slots__ = ("non_finite",)

    def __init__(self) -> None:
        self.non_finite = False

    def __call__(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.non_finite = True
        return value


def _non_finite_path(obj: Any) -> str | None:
    """OpenAI's path (``a.b[2].c``) to the first non-finite float in ``obj``."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path or None
        elif isinstance(value, dict):
            items = list(value.items())
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(items))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


_NOT_PARSED: Final = object()
_JSON_WS: Final = b" \t\n\r"
_INT64: Final = 2.0**63
#: False while a body is re-parsed by the stdlib json (see _MaybeBigInt).
_FAST_PARSE: ContextVar[bool] = ContextVar("kvgate_fast_json", default=True)
_R = TypeVar("_R")


class _MaybeBigInt(Exception):
    """orjson reads an integer beyond 64 bits as a float, json as an int: an integral
    float that large where an integer is expected sends the body to json instead."""


def parse_json_object(
    body: bytes, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> dict[str, Any]:
    """Body bytes -> a JSON object (size limit, UTF-8, strict JSON: no NaN/Infinity)."""
    return _parse_json_object(body, max_body_bytes, fast=True)


def _parse_json_object(body: bytes, max_body_bytes: int, *, fast: bool) -> dict[str, Any]:
    if len(body) > max_body_bytes:
        raise RequestTooLargeError(
            f"Request body is {len(body)} bytes, above the limit of {max_body_bytes} bytes.",
            code="request_too_large",
        )
    obj: Any = _NOT_PARSED
    if fast and _orjson is not None:
        # orjson is strict (UTF-8 only, no NaN/Infinity, no number beyond a double's
        # range, 64-bit ints): what it takes, json takes the same way; anything it
        # refuses goes to json for the verdict.
        with contextlib.suppress(_orjson.JSONDecodeError):
            obj = _orjson.loads(body)
    floats = _FloatReader()
    try:
        if obj is _NOT_PARSED:
            obj = json.loads(body, parse_constant=_reject_constant, parse_float=floats)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidJSONError(
            "We could not parse the JSON body of your request. The API expects a JSON "
            "payload, but what was sent was not valid JSON."
        ) from exc
    if floats.non_finite:
        # refused here, not by the field's own check: any field may hold it, and the
        # body could not be written back (with_fields) nor read by an engine
        param = _non_finite_path(obj)
        raise InvalidValueError(
            f"Invalid '{param}': must be a finite number." if param is not None
            else "Invalid request body: numbers must be finite.", param=param)
    if not isinstance(obj, dict):
        raise InvalidJSONError(
            f"Invalid type for request body: expected an object, but got {type_name(obj)} "
            "instead.", code="invalid_type")
    return obj


def _missing(param: str) -> MissingParameterError:
    return MissingParameterError(f"Missing required parameter: '{param}'.", param=param)


def _bad_type(param: str, expected: str, value: object) -> InvalidTypeError:
    return InvalidTypeError(
        f"Invalid type for '{param}': expected {expected}, but got {type_name(value)} instead.",
        param=param,
    )


def _is_int(value: object) -> bool:
    if isinstance(value, float) and abs(value) >= _INT64 and _FAST_PARSE.get():
        raise _MaybeBigInt
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(body: bytes, max_body_bytes: int, build: Callable[[dict[str, Any]], _R]) -> _R:
    """Parse ``body`` and ``build`` the request from it; a body that may hold an integer
    beyond 64 bits (see _MaybeBigInt) is parsed again by json and built again."""
    try:
        return build(parse_json_object(body, max_body_bytes=max_body_bytes))
    except _MaybeBigInt:
        token = _FAST_PARSE.set(False)
        try:
            return build(_parse_json_object(body, max_body_bytes, fast=False))
        finally:
            _FAST_PARSE.reset(token)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _opt_int(d: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = d.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad_type(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise InvalidValueError(
            f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, "
            f"but got {value} instead.", param=name, code="integer_below_min_value")
    return int(value)


def _opt_number(d: Mapping[str, Any], name: str, low: float, high: float, *,
                low_open: bool = False) -> float | None:
    value = d.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise _bad_type(name, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        # JSON like 1e309 parses to inf: not a bound question
        raise InvalidValueError(f"Invalid '{name}': must be a finite number.", param=name)
    # the bounds are checked on the value as sent (Python compares an int with a float
    # exactly): an integer of 400 digits is out of range, not too large for float()
    if value < low or (low_open and value <= low):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise InvalidValueError(
            f"Invalid '{name}': decimal below minimum value. Expected a value {bound}, "
            f"but got {_shown(value)} instead.", param=name, code="decimal_below_min_value")
    if value > high:
        raise InvalidValueError(
            f"Invalid '{name}': decimal above maximum value. Expected a value <= {high:g}, "
            f"but got {_shown(value)} instead.", param=name, code="decimal_above_max_value")
    return float(value)


def _shown(value: float) -> str:
    """A number as an error message quotes it: a huge integer by its size, not its
    hundreds of digits."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return str(value)


def _opt_bool(d: Mapping[str, Any], name: str, param: str | None = None) -> bool | None:
    value = d.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad_type(param or name, "a boolean", value)
    return value


def _opt_str(d: Mapping[str, Any], name: str) -> str | None:
    value = d.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad_type(name, "a string", value)
    return value


def _common(d: Mapping[str, Any]) -> _Common:
    model = d.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _bad_type("model", "a string", model)
    if not model:
        raise InvalidValueError("Invalid 'model': empty string.", param="model",
                                code="empty_string")
    max_tokens = _opt_int(d, "max_tokens", minimum=1)
    max_completion = _opt_int(d, "max_completion_tokens", minimum=1)
    stream = bool(_opt_bool(d, "stream"))
    include_usage = False
    options = d.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad_type("stream_options", "an object", options)
        if not stream:
            raise InvalidValueError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options")
        include_usage = bool(_opt_bool(options, "include_usage", "stream_options.include_usage"))
        _opt_bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    n = _opt_int(d, "n", minimum=1)
    if n is not None and n != 1:
        raise UnsupportedParameterError(
            f"Invalid 'n': only n=1 is supported by kvgate, but got {n}.", param="n")
    return _Common(
        model=model,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stream=stream,
        include_usage=include_usage,
        temperature=_opt_number(d, "temperature", 0.0, 2.0),
        top_p=_opt_number(d, "top_p", 0.0, 1.0, low_open=True),
        n=1,
        priority=_opt_int(d, "priority"),
        user=_opt_str(d, "user"),
        stop=_stop(d.get("stop")),
        cache_salt=_cache_salt(d),
    )


def _cache_salt(d: Mapping[str, Any]) -> str | None:
    salt = _opt_str(d, "cache_salt")
    if salt == "":  # vLLM refuses it too: an empty salt would key apart from no salt
        raise InvalidValueError("Invalid 'cache_salt': must be a non-empty string if provided.",
                                param="cache_salt", code="empty_string")
    return salt


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise _bad_type("stop", "a string or an array of strings", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise _bad_type(f"stop[{i}]", "a string", item)
    return tuple(value)


_TOKEN_ID_LIMIT = 2**32  # token ids are hashed as unsigned 32-bit ints (vLLM's too)


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    # the usual case checked at C speed (a 16 MB body holds millions of ids, and one
    # Python call per id held the event loop for seconds); the loop below names the
    # first bad id
    if set(map(type, value)) == {int} and min(value) >= 0 and max(value) < _TOKEN_ID_LIMIT:
        return tuple(value)
    for i, tok in enumerate(value):
        if not _is_int(tok):
            raise _bad_type(f"{param}[{i}]", "an integer", tok)
        if not 0 <= tok < _TOKEN_ID_LIMIT:
            raise InvalidValueError(f"Invalid '{param}[{i}]': token ids must be >= 0 and "
                                    f"< 2**32, but got {tok} instead.", param=f"{param}[{i}]")
    return tuple(value)


def _prompt(d: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = d.get("prompt")
    if prompt is None:
        raise _missing("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list):
        raise _bad_type("prompt", "a string or an array", prompt)
    if not prompt:
        raise InvalidValueError("Invalid 'prompt': empty array. Expected an array with minimum "
                                "length 1, but got an empty array instead.", param="prompt",
                                code="empty_array")
    if _is_int(prompt[0]):
        return None, _token_ids(prompt, "prompt")
    if len(prompt) > 1:
        if all(isinstance(p, str | list) for p in prompt):
            raise BatchedPromptError(
                f"Invalid 'prompt': batched prompts are not supported (got {len(prompt)} "
                "prompts); send one prompt per request.", param="prompt")
        bad = next(i for i, p in enumerate(prompt) if not isinstance(p, str | list))
        raise _bad_type(f"prompt[{bad}]", "a string or an array of integers", prompt[bad])
    only = prompt[0]
    if isinstance(only, str):
        return only, None
    if isinstance(only, list):
        if not only:
            raise InvalidValueError("Invalid 'prompt[0]': empty array.", param="prompt",
                                    code="empty_array")
        return None, _token_ids(only, "prompt[0]")
    raise _bad_type("prompt[0]", "a string or an array of integers", only)


def parse_completion_request(body: bytes, *,
                             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    return _validate(body, max_body_bytes, _completion_request)


def _completion_request(d: dict[str, Any]) -> CompletionRequest:
    c = _common(d)
    text, tokens = _prompt(d)
    return CompletionRequest(
        model=c.model, max_tokens=c.max_tokens, stream=c.stream, include_usage=c.include_usage,
        temperature=c.temperature, top_p=c.top_p, n=c.n, priority=c.priority, user=c.user,
        stop=c.stop, cache_salt=c.cache_salt, prompt_text=text, prompt_token_ids=tokens, raw=d,
    )


def _content(message: Mapping[str, Any], role: str, where: str, media: list[str]) -> str:
    """A message's text: a string, or its parts' texts joined. A media part (an image,
    audio, a video, a file) stands in the text as a marker made from its content, so the
    same image keys the same prefix for routing and another image does not; its param
    is added to ``media`` (the simulated engine refuses them, a real one reads them)."""
    content = message.get("content")
    if content is None:
        if role == "assistant":  # tool-call turns may carry no content
            return ""
        raise _missing(f"{where}.content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_type(f"{where}.content", "a string or an array of content parts", content)
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _bad_type(at, "an object", part)
        kind = part.get("type")
        if kind is None:
            raise _missing(f"{at}.type")
        if kind in MEDIA_PART_TYPES:
            texts.append(_media_marker(part, kind, at))
            media.append(f"{at}.{kind}")
            continue
        # an assistant turn's refusal is text the model wrote, as vLLM renders it
        if kind not in ("text", "refusal"):
            raise UnsupportedContentError(
                f"Invalid '{at}.type': content parts of type {kind!r} are not supported; "
                f"only 'text', an assistant's 'refusal' and the media types "
                f"{', '.join(map(repr, MEDIA_PART_TYPES))} are.", param=f"{at}.type")
        text = part.get(kind)  # the part's text is under its type's name
        if text is None:
            raise _missing(f"{at}.{kind}")
        if not isinstance(text, str):
            raise _bad_type(f"{at}.{kind}", "a string", text)
        texts.append(text)
    return TEXT_PART_SEPARATOR.join(texts)


def _media_marker(part: Mapping[str, Any], kind: str, at: str) -> str:
    """The text a media part stands as: its type and a hash of its content (a URL, a
    data URL, base64 audio), which is under the part's type's name."""
    value = part.get(kind)
    if value is None:
        raise _missing(f"{at}.{kind}")
    if not isinstance(value, dict | str):
        raise _bad_type(f"{at}.{kind}", "an object", value)
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except RecursionError as exc:
        raise _too_deep() from exc
    digest = xxhash.xxh3_64_hexdigest(text.encode("utf-8", "backslashreplace"))
    return f"\x00{kind}:{digest}\x00"


def _messages(d: Mapping[str, Any], media: list[str]) -> tuple[tuple[str, str], ...]:
    messages = d.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list):
        raise _bad_type("messages", "an array", messages)
    if not messages:
        raise InvalidValueError("Invalid 'messages': empty array. Expected an array with "
                                "minimum length 1, but got an empty array instead.",
                                param="messages", code="empty_array")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, "an object", message)
        role = message.get("role")
        if role is None:
            raise _missing(f"{where}.role")
        # vLLM takes any role its chat template knows (Llama 3.1's "ipython", OpenAI's
        # legacy "function"): the role only feeds the prompt, and the template judges it
        if not isinstance(role, str):
            raise _bad_type(f"{where}.role", "a string", role)
        if not role:
            raise InvalidValueError(f"Invalid '{where}.role': empty string. Expected a role "
                                    f"such as {', '.join(map(repr, CHAT_ROLES))}.",
                                    param=f"{where}.role")
        out.append((role, _content(message, role, where, media)))
    return tuple(out)


def parse_chat_request(body: bytes, *,
                       max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body."""
    return _validate(body, max_body_bytes, _chat_request)


def _chat_request(d: dict[str, Any]) -> ChatRequest:
    c = _common(d)
    media: list[str] = []
    messages = _messages(d, media)
    return ChatRequest(
        model=c.model, max_tokens=c.max_tokens, stream=c.stream, include_usage=c.include_usage,
        temperature=c.temperature, top_p=c.top_p, n=c.n, priority=c.priority, user=c.user,
        stop=c.stop, cache_salt=c.cache_salt, messages=messages, media=tuple(media), raw=d,
    )


def with_fields(raw: Mapping[str, Any], **updates: Any) -> bytes:
    """Re-serialise ``raw`` with top-level ``updates`` (key order kept, new keys appended).

    An object value is merged into an existing object (so
    ``stream_options={"include_usage": True}`` keeps the client's other stream
    options); :data:`REMOVE` deletes the key. ``raw`` itself is not modified.
    The output is UTF-8 JSON; a lone surrogate the client sent as ``\\ud800`` (valid
    JSON, not encodable in UTF-8) goes out as the same escape. A body nested too deeply to
    be written back is the client's :class:`InvalidJSONError` (400), never a crash.
    """
    out = dict(raw)
    for key, value in updates.items():
        if value is REMOVE:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    try:
        text = json.dumps(out, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except RecursionError as exc:
        raise _too_deep() from exc
    # UTF-8 as the client's text came; a lone surrogate (only ever inside a JSON string,
    # and the one thing UTF-8 cannot encode) is written as its \uXXXX escape
    return text.encode("utf-8", "backslashreplace")


def _too_deep() -> InvalidJSONError:
    return InvalidJSONError(
        "The JSON body of your request is nested too deeply to be processed.",
        code="json_too_deep")


def edit_body(body: bytes, raw: Mapping[str, Any], updates: Mapping[str, Any]) -> bytes:
    """``body`` (whose parsed object is ``raw``) with top-level ``updates``: the same
    result as :func:`with_fields`, but when every update only adds a key that ``raw``
    lacks, the new members are spliced in before the closing brace of the original
    bytes instead of re-serialising the whole body (the client's bytes are kept)."""
    if not updates:
        return body
    end = len(body.rstrip(_JSON_WS)) - 1
    if (
        _orjson is None
        or end < 1
        or body[end] != 0x7D  # "}"
        or body.lstrip(_JSON_WS)[:1] != b"{"
        or b"\x00" in body[:4]  # UTF-16/32: json.loads detects it; never splice there
        or any(value is REMOVE or key in raw for key, value in updates.items())
    ):
        return _reserialise(body, raw, updates)
    try:
        members = b",".join(
            _orjson.dumps(key) + b":" + _orjson.dumps(value) for key, value in updates.items()
        )
    except TypeError:  # not JSON-serialisable by orjson: json decides
        return _reserialise(body, raw, updates)
    sep = b"," if raw else b""
    return body[:end] + sep + members + body[end:]


def _reserialise(body: bytes, raw: Mapping[str, Any], updates: Mapping[str, Any]) -> bytes:
    # ``raw`` may come from orjson (integers past 64 bits as floats): re-serialise what
    # the stdlib json reads from the same bytes, as before orjson.
    try:
        exact: Mapping[str, Any] = json.loads(body, parse_constant=_reject_constant)
    except RecursionError as exc:  # orjson read it; json can neither read nor write it
        raise _too_deep() from exc
    except ValueError:
        exact = raw
    if not isinstance(exact, dict):
        exact = raw
    return with_fields(exact, **updates)
