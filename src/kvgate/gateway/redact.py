"""URLs fit to show: without their passwords (views, logs, error messages)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` without its password (``http://user:pw@h`` -> ``http://user:***@h``), for
    every view and log line that shows a node's or Redis' URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED if "@" in url else url
    if parts.query:
        # redis-py also reads ?password=, its key percent-decoded (pass%77ord) and its
        # case kept: every key that decodes to it is hidden
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in query):
            query = [(k, REDACTED if k.lower() == "password" else v) for k, v in query]
            parts = parts._replace(query=urlencode(query, safe="*"))
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        parts = parts._replace(netloc=f"{user}:{REDACTED}@{host}" if sep or not user
                               else f"{REDACTED}@{host}")
    out = urlunsplit(parts)
    if not parts.netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path
        out = f"{parts.scheme}://{out[len(parts.scheme) + 1:]}"
    return out
