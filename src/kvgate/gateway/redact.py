"""URLs fit to show: without their passwords (views, logs, error messages)."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# what may follow the last '@' of a URL that did not parse: a host, a port, a short path
_HOST_TAIL = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?(/\w*)?")


def redact_url(url: str) -> str:
    """``url`` without its password (``http://user:pw@h`` -> ``http://user:***@h``), for
    every view and log line that shows a node's or Redis' URL."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a broken IPv6 literal
        return _unparsable(url)
    if "@" in parts.path + parts.query + parts.fragment and "@" not in parts.netloc:
        # a '#', '/' or '?' in the password ended the host early: the password sits in
        # what urlsplit calls the path, query or fragment
        return _unparsable(url)
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


def _unparsable(url: str) -> str:
    """A URL urlsplit cannot take apart, shown without anything that may be its userinfo:
    ``scheme://***@host:port`` when what follows its last '@' is plainly a host, else
    ``scheme://...``."""
    if "@" not in url and "password" not in url.lower():
        return url  # no credentials in it (a bad port, a broken IPv6 literal)
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return REDACTED
    userinfo, at, tail = rest.rpartition("@")
    # '=' before the '@': a query (?password=a@b) whose tail is the password's end
    if at and "=" not in userinfo and _HOST_TAIL.fullmatch(tail):
        return f"{scheme}://{REDACTED}@{tail}"
    return f"{scheme}://..."
