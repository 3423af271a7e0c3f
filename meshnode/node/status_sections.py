"""What ``meshnode status`` shows of a node besides the mesh: where its OpenAI-compatible API
listens, and the named sections that what runs on the node adds (:class:`StatusSections`).

The head tells the node its API's address and adds its sections; the status report
(:func:`meshnode.node.status_report.node_status`) reads them at every report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

# A section's content now, called at every report.
SectionProvider = Callable[[], dict[str, Any]]


class StatusSections:
    def __init__(self) -> None:
        self._api_url: str | None = None
        self._sections: dict[str, SectionProvider] = {}

    @property
    def api_url(self) -> str | None:
        """Where the node's OpenAI-compatible API listens, once a head serves one there."""
        return self._api_url

    def set_api_url(self, url: str) -> None:
        self._api_url = url

    @property
    def sections(self) -> Mapping[str, SectionProvider]:
        return MappingProxyType(self._sections)

    def add(self, name: str, provider: SectionProvider) -> None:
        """Show ``provider()`` as the section ``name`` (replacing one so named)."""
        self._sections[name] = provider

    def remove(self, name: str) -> None:
        self._sections.pop(name, None)


__all__ = ["SectionProvider", "StatusSections"]
