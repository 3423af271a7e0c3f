"""Where the head's API listens and how it drives generations (:class:`HeadConfig`), apart
from the head service so that the command line reads them without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode.api.access import ApiAccess
from meshnode.head.driver_config import DriverConfig

DEFAULT_API_HOST = "127.0.0.1"
DEFAULT_API_PORT = 8080
DEFAULT_API_LISTEN = f"{DEFAULT_API_HOST}:{DEFAULT_API_PORT}"


@dataclass(frozen=True)
class HeadConfig:
    api_host: str = DEFAULT_API_HOST
    api_port: int = DEFAULT_API_PORT
    driver: DriverConfig = field(default_factory=DriverConfig)
    # Who may call the API (--api-key, --cors-origin).
    access: ApiAccess = field(default_factory=ApiAccess)


__all__ = ["DEFAULT_API_HOST", "DEFAULT_API_LISTEN", "DEFAULT_API_PORT", "HeadConfig"]
