"""One timed request to an OpenAI-compatible server (completions or chat).

Streaming (the default) reads the Server-Sent Events byte stream itself: each
``data:`` line is a JSON chunk. As in ``vllm bench serve``, every chunk with a non-empty
``choices`` list is timed when its bytes arrive (the first gives TTFT, the others ITL
gaps), its text empty or not (a special token's is); a chunk whose choices carry
non-empty ``text`` (completions) or ``delta.content`` / ``delta.reasoning_content``
(chat) is a *token chunk*. ``stream_options.include_usage`` is requested so the final
chunk carries ``usage`` (prompt, completion and ``prompt_tokens_details.cached_tokens``;
vLLM reports the last one only when started with ``--enable-prompt-tokens-details``).
A stream without any chunk with choices (say only ``{"choices": [], "usage": ...}``)
fails with ``empty_output``, as vLLM's bench fails it (no TTFT), whatever its usage
says. Lines may end in ``\n``, ``\r\n`` or a lone ``\r`` (the SSE spec's three); a line
longer than :data:`MAX_LINE_BYTES` fails with ``bad_response``. A stream whose body ends
before ``data: [DONE]`` (or an error event) fails with ``truncated``, as the gateway
fails it: the server stopped mid-answer, so its tokens so far are no answer. After
``[DONE]`` the rest of the body (the chunked terminator) is read, within
:data:`DRAIN_TIMEOUT_S`, so the connection goes back to the pool.

E2E latency ends, as in ``vllm bench serve``, at the last chunk with choices (the
trailing usage chunk, ``[DONE]`` and the end of the body do not count). So
``E2E - TTFT`` is the sum of the ITL gaps. Without streaming the body is the one data
chunk: E2E ends when it has been read, before it is parsed. There is no TTFT or ITL
then; a body without choices fails with ``empty_output``, as a stream without any does.

Without usage the output tokens are estimated from the text (``chars_per_token``
characters each, at least one), where vLLM's bench re-tokenizes it; a stream counts at
least one per token chunk.

A request that times out (``--request-timeout``) fails with error ``timeout``, one whose
connection fails (refused, or reset mid-stream) with ``connection``, a stream cut short
(above) with ``truncated``; all have status 0, as when no response arrived: headers
without the rest of the answer are no answer (they were counted under their 200). The
detail says whether headers had come. A refusal's error detail is the start of its body
(:data:`ERROR_BODY_BYTES`), not waited for whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from kvgate.loadgen.report import RequestResult
from kvgate.protocol.sse import DEFAULT_MAX_EVENT_BYTES

ENDPOINTS = ("completions", "chat")

MAX_LINE_BYTES = DEFAULT_MAX_EVENT_BYTES
"""Longest SSE line read: the gateway's bound on an event, so whatever it relays is read
whole; past it the request fails (a line without an end was buffered without limit)."""

ERROR_BODY_BYTES = 512
"""Bytes of a refusal's body read for its error detail: the status is the answer, and an
endless body must not hold the request until its timeout."""

DRAIN_TIMEOUT_S = 0.1
"""How long the rest of a body after ``[DONE]`` is waited for (the gateway's bound too)."""

DRAIN_BYTES = 64 * 1024
"""The most of it read; a server still sending past it loses the connection instead."""


def check_base_url(base_url: str, name: str = "base_url") -> None:
    """ValueError (one line, naming ``name``) unless ``base_url`` is http(s)://host[:port]
    with a port in 1..65535 and no query or fragment: a malformed one failed every
    request as a ``connection`` failure instead of stopping the run before it began."""
    try:
        parts = urlsplit(base_url)
        port = parts.port
    except ValueError as e:  # a port out of range or not a number
        raise ValueError(f"{name}: {e} (expected http://host:port)") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{name} must start with http:// or https:// "
                         "(e.g. http://127.0.0.1:8000)")
    if not parts.hostname:
        raise ValueError(f"{name} has no host (expected http://host:port)")
    if port == 0:
        raise ValueError(f"{name}: port 0 is no port to connect to")
    if parts.query or parts.fragment or "?" in base_url or "#" in base_url:
        # /v1/... is appended to it: a query or fragment would swallow the path
        raise ValueError(f"{name} must not have a query or fragment")


def v1_base(base_url: str) -> str:
    """``http://h:8000`` or ``http://h:8000/v1`` -> ``http://h:8000/v1``."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def endpoint_url(base_url: str, endpoint: str) -> str:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    path = "/completions" if endpoint == "completions" else "/chat/completions"
    return v1_base(base_url) + path


def one_line(text: str, limit: int = 200) -> str:
    """``text`` as one line of at most ``limit`` characters (for error messages)."""
    return " ".join(text.split())[:limit]


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id listed by ``GET /v1/models``; RuntimeError (one line) when the
    answer is not a 200 JSON list of models."""
    async with session.get(v1_base(base_url) + "/models") as resp:
        if resp.status != 200:
            body = one_line(await _error_body(resp))
            raise RuntimeError(f"GET /v1/models returned HTTP {resp.status}: {body}")
        raw = await resp.read()
        try:
            data = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8: a login page, a proxy's error page
            kind = resp.headers.get("Content-Type", "no Content-Type")
            body = one_line(raw.decode("utf-8", errors="replace"), 80)
            raise RuntimeError(
                f"GET /v1/models did not return JSON ({kind}: {body!r}); "
                "check --base-url or pass --model"
            ) from None
    models = data.get("data") if isinstance(data, dict) else None
    first = models[0] if isinstance(models, list) and models else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise RuntimeError("GET /v1/models listed no models; pass --model")
    return str(first["id"])


def build_payload(
    *,
    endpoint: str,
    model: str,
    prompt: str,
    max_tokens: int,
    stream: bool = True,
    ignore_eos: bool = False,
    temperature: float = 0.0,
) -> dict[str, object]:
    """The JSON body of one request (``ignore_eos`` is a vLLM/SGLang extension)."""
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens,
                               "temperature": temperature, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass(slots=True)
class _StreamState:
    sent: float
    # the last chunk with choices; without streaming, when a body with choices was read
    last: float | None = None
    ttft: float | None = None
    chunks: int = 0  # token chunks
    chars: int = 0  # characters of text in them (or in the whole body)
    itl: list[float] = field(default_factory=list)
    usage: dict[str, object] | None = None
    error: str = ""


def _choice_text(choice: object) -> str:
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")
    if isinstance(text, str) and text:
        return text
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            for k in ("content", "reasoning_content"):
                v = part.get(k)
                if isinstance(v, str) and v:
                    return v
    return ""


def _on_event(st: _StreamState, data: bytes, now: float) -> bool:
    """Handle one ``data:`` payload; False when it ends the stream: ``[DONE]`` or an
    error event."""
    if data == b"[DONE]":
        return False
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("stream chunk is not a JSON object")
    if "error" in obj:
        st.error = json.dumps(obj["error"])[:300]
        return False
    usage = obj.get("usage")
    if isinstance(usage, dict):
        st.usage = usage
    choices = obj.get("choices")
    if isinstance(choices, list) and choices:
        if st.last is None:
            st.ttft = now - st.sent
        else:
            st.itl.append(now - st.last)
        st.last = now
        chars = sum(len(_choice_text(c)) for c in choices)
        if chars:
            st.chunks += 1
            st.chars += chars
    return True


def _usage_int(usage: dict[str, object] | None, key: str) -> int | None:
    v = usage.get(key) if usage else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _cached(usage: dict[str, object] | None) -> int | None:
    details = usage.get("prompt_tokens_details") if usage else None
    return _usage_int(details, "cached_tokens") if isinstance(details, dict) else None


async def _read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """Up to ``limit`` bytes of a body (fewer when it ends first)."""
    buf = bytearray()
    while len(buf) < limit:
        chunk = await content.read(limit - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


async def _error_body(resp: aiohttp.ClientResponse) -> str:
    """The start of a refusal's body, best effort: the status is the answer, so a body
    that times out or is not UTF-8 must not turn it into a timeout or bad_response, and
    one that never ends must not hold the request (it was read whole)."""
    try:
        head = await _read_at_most(resp.content, ERROR_BODY_BYTES)
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"(body not read: {type(e).__name__})"
    return head.decode("utf-8", errors="replace")[:300]


async def _drain(content: aiohttp.StreamReader) -> None:
    """Read what follows ``[DONE]`` (the chunked terminator), briefly: aiohttp reuses a
    connection only when its body was read to the end, and closed about half of them.
    Best effort: the answer is complete and timed already."""
    if content.at_eof():
        return
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            await _read_at_most(content, DRAIN_BYTES)


def _check_line(size: int) -> None:
    if size > MAX_LINE_BYTES:
        raise ValueError(f"an SSE line longer than {MAX_LINE_BYTES} bytes")


def _on_line(st: _StreamState, line: bytes, now: float) -> bool:
    """Handle one SSE line; False when it ends the stream (``[DONE]``, an error event)."""
    line = line.strip()
    return not line.startswith(b"data:") or _on_event(st, line[5:].strip(), now)


async def _read_stream(resp: aiohttp.ClientResponse, st: _StreamState) -> bool:
    """Read events until ``[DONE]`` or an error event (True) or the end of the body
    (False: cut short). ValueError on a line past :data:`MAX_LINE_BYTES`."""
    partial = bytearray()  # a line whose end has not come yet
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        if b"\r" in data:  # CRLF or a lone CR ends a line too (SSE); one scan when not
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # only the new bytes are searched for line ends (the whole buffer was, each read)
        *lines, rest = data.split(b"\n")
        if lines:
            lines[0] = bytes(partial) + lines[0]
            partial.clear()
        partial += rest
        for line in lines:
            _check_line(len(line))
            if not _on_line(st, line, now):
                return True
        _check_line(len(partial))  # bounded before the next read, not once the line ends
    # a last line without its newline still counts (a [DONE] there ends the stream)
    return not _on_line(st, bytes(partial), time.perf_counter())


async def send_request(
    session: aiohttp.ClientSession,
    *,
    url: str,
    payload: dict[str, object],
    request_id: str,
    prompt_tokens: int,
    t0: float,
    chars_per_token: float = 4.0,
) -> RequestResult:
    """POST ``payload`` to ``url`` and time it; never raises except on cancellation.

    ``prompt_tokens`` is the estimate used when the server reports no usage; ``t0`` is
    the ``time.perf_counter()`` of the benchmark start.
    """
    stream = bool(payload.get("stream"))
    res = RequestResult(request_id=request_id, success=False, status=0,
                        prompt_tokens=prompt_tokens)
    st = _StreamState(sent=time.perf_counter())
    res.start_s = st.sent - t0
    try:
        async with session.post(url, json=payload) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = "http"
                res.error_detail = f"HTTP {resp.status}: {await _error_body(resp)}"
            elif stream:
                if await _read_stream(resp, st):
                    await _drain(resp.content)
                else:  # EOF before [DONE]: the server stopped mid-answer (gateway: failure)
                    res.status = 0
                    res.error = "truncated"
                    res.error_detail = (f"the body ended after HTTP {resp.status} headers "
                                        f"and {st.chunks} token chunks, before data: [DONE]")
            else:
                raw = await resp.read()
                read_at = time.perf_counter()  # the whole body: its one data chunk
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("response is not a JSON object")
                if "error" in body:
                    st.error = json.dumps(body["error"])[:300]
                usage = body.get("usage")
                st.usage = usage if isinstance(usage, dict) else None
                choices = body.get("choices")
                if isinstance(choices, list) and choices:
                    st.last = read_at
                    # one body, no chunks to count: the text's estimated tokens (it was
                    # 1 whatever the length when the server sent no usage)
                    st.chars = sum(len(_choice_text(c)) for c in choices)
    except TimeoutError as e:
        # the answer never came whole: no status, whatever the headers said (listed
        # under 200 it read as the server's fault, not as a timeout)
        got = f" after HTTP {res.status} headers" if res.status else ""
        res.status = 0
        res.error, res.error_detail = "timeout", f"timeout{got}: {e!r}"[:300]
    except aiohttp.ClientError as e:
        # a reset after the headers is no answer either (it was filed under their 200)
        got = f" after HTTP {res.status} headers" if res.status else ""
        res.status = 0
        res.error = "connection"
        res.error_detail = f"{type(e).__name__}{got}: {e}"[:300]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        # JSON and shape problems; RecursionError: JSON nested too deep to decode, the
        # server's fault like any malformed body (it was reported as a loadgen bug)
        res.error, res.error_detail = "bad_response", f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    res.end_s = end - t0
    if res.error:
        return res
    if st.error:
        res.error, res.error_detail = "stream_error", st.error
        return res
    completion = _usage_int(st.usage, "completion_tokens")
    reported_prompt = _usage_int(st.usage, "prompt_tokens")
    if reported_prompt is not None:
        res.prompt_tokens, res.prompt_tokens_reported = reported_prompt, True
    res.cached_tokens = _cached(st.usage)
    # Without usage: the text's estimate, but at least one per token chunk. Chunks alone
    # undercount a server that bundles tokens in a chunk; the text alone undercounts
    # tokens shorter than chars_per_token, which a chunk each still proves.
    estimate = max(st.chunks, math.ceil(st.chars / chars_per_token))
    res.output_tokens = completion if completion is not None else estimate
    if st.last is None:
        # vLLM's bench fails a stream so ("Never received a valid chunk to calculate
        # TTFT"): usage alone is no answer to time, and it was a success without a TTFT.
        # A whole body without choices is none either (it was a success).
        res.error = "empty_output"
        res.error_detail = ("the stream carried no chunk with choices (no TTFT)" if stream
                            else "the response carried no choices")
        return res
    if estimate == 0 and not res.output_tokens:
        res.error, res.error_detail = "empty_output", "the response carried no tokens"
        return res
    res.success = True
    # vLLM's latency: to the last chunk with choices, the body without streaming; `end`
    # came later, after [DONE], the drain and the release
    res.e2e_s = st.last - st.sent
    if stream:
        res.ttft_s = st.ttft
        res.itl_s = st.itl
    return res
