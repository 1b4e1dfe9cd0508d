"""Who is calling, and at which priority: API key -> tenant, priority cap, bypass.

* Auth is on when ``auth.keys`` is non-empty. A request then needs
  ``Authorization: Bearer <key>`` naming a configured key (else 401). Keys are
  compared by their SHA-256 digest, so the lookup does not depend on how much of
  a guessed key matches.
* With auth off everyone is tenant ``default`` and capped at
  ``auth.anonymous_max_priority``.
* The priority is ``X-Kvgate-Priority`` if present, else the body's ``priority``,
  else ``auth.default_priority``; it is then capped by the caller's best allowed
  class: ``effective = max(requested, cap)`` (0 is the most important), so no
  header or body field can raise a tenant above its cap. Tenant, quota and the
  bypass lane come from the key only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.core.errors import AuthError, ClientRequestError
from kvgate.core.ids import DEFAULT_TENANT, TenantId
from kvgate.gateway.config import AuthConfig

PRIORITY_HEADER = "X-Kvgate-Priority"


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    tenant: TenantId
    max_priority: int  # best class allowed (0 = P0)
    bypass: bool = False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    __slots__ = ("_anonymous", "_by_digest", "default_priority")

    def __init__(self, config: AuthConfig) -> None:
        self._by_digest: dict[bytes, Identity] = {
            _digest(key): Identity(
                tenant=TenantId(spec.tenant), max_priority=spec.max_priority, bypass=spec.bypass
            )
            for key, spec in config.keys.items()
        }
        self._anonymous = Identity(
            tenant=DEFAULT_TENANT, max_priority=config.anonymous_max_priority
        )
        self.default_priority = config.default_priority

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def identify(self, headers: Mapping[str, str]) -> Identity:
        """The caller's identity; raises :class:`AuthError` (401) when auth is on and the
        key is missing or unknown."""
        if not self._by_digest:
            return self._anonymous
        auth = headers.get("Authorization")
        if auth is None:
            raise AuthError(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
            )
        scheme, _, key = auth.strip().partition(" ")
        identity = None
        if scheme.lower() == "bearer" and key.strip():
            identity = self._by_digest.get(_digest(key.strip()))
        if identity is None:
            raise AuthError("Incorrect API key provided.", code="invalid_api_key")
        return identity

    def priority(
        self, identity: Identity, header: str | None, body_priority: int | None
    ) -> int:
        """The effective class (see the module doc); bad values are a 400."""
        requested: int
        if header is not None:
            text = header.strip()
            if text not in ("0", "1", "2"):
                raise ClientRequestError(
                    f"Invalid {PRIORITY_HEADER} header {header[:20]!r}: expected 0, 1 or 2.",
                    param=PRIORITY_HEADER,
                    code="invalid_value",
                )
            requested = int(text)
        elif body_priority is not None:
            if body_priority not in (0, 1, 2):
                raise ClientRequestError(
                    f"Invalid 'priority': expected 0, 1 or 2, but got {body_priority} instead.",
                    param="priority",
                    code="invalid_value",
                )
            requested = body_priority
        else:
            requested = self.default_priority
        return max(requested, identity.max_priority)
