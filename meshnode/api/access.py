"""Who may call the API (:class:`ApiAccess`: ``--api-key``, ``--cors-origin``), apart from the
aiohttp middleware that enforces it (:mod:`meshnode.api.auth`) so that the command line reads
it without loading aiohttp."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

# The ``--cors-origin`` that answers every origin.
ANY_ORIGIN = "*"


@dataclass(frozen=True)
class ApiAccess:
    # None: no authentication (the API binds to loopback by default).
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()

    def __repr__(self) -> str:
        # Dataclass reprs end up in logs and tracebacks; the key must not.
        key = "set" if self.api_key else "none"
        return f"ApiAccess(api_key=<{key}>, cors_origins={self.cors_origins!r})"

    def origin_allowed(self, origin: str) -> bool:
        return ANY_ORIGIN in self.cors_origins or origin in self.cors_origins

    def key_matches(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self.api_key.encode())


__all__ = ["ANY_ORIGIN", "ApiAccess"]
