"""``meshnode status`` and ``meshnode generate`` for a ``meshnode serve`` process.

A server of one has no mesh, but a person who started it asks it the same
questions as a node: what it serves, how busy it is, its memory, and where its
API is. Its data directory's status socket answers them, as a node's does
(meshnode.statussocket.standalone: unless a node already answers there).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engines.resident_memory import shard_memory
from meshnode.app.prefix_cache_status import PREFIX_CACHE_SECTION
from meshnode.node.status_report import CapacityStatus, LoadStatus, ServingStatus
from meshnode.node.status_sections import SectionProvider
from meshnode.statussocket.server import StatusServer
from meshnode.statussocket.standalone import answer_status
from meshnode.wire.pb import mesh


@dataclass(frozen=True)
class StandaloneServer:
    api_url: str
    serving: ServingStatus | None
    capacity: CapacityStatus
    load: LoadStatus
    uptime_s: float


@dataclass(frozen=True)
class StandaloneStatus:
    """The status socket's answer for a standalone server: ``standalone`` in place of a node's
    ``node``, no peers, and the node's ``memory`` and ``prefix_cache`` sections."""

    standalone: StandaloneServer
    sections: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def standalone_status(
    api_url: str,
    announcement: mesh.PeerAnnouncement,
    started: float,
    prefix_cache: SectionProvider | None = None,
) -> StandaloneStatus:
    """What the server says of itself now; ``announcement`` is what its shard service keeps up to date
    (serving, capacity, load: meshnode.head.environment.StandaloneShardHost); ``prefix_cache``: its
    shard's prefix cache section (meshnode.app.shard_service.ShardService.prefix_cache_status)."""
    memory = shard_memory()
    sections: dict[str, Any] = {}
    if memory is not None and memory.budget.total_bytes:
        sections["memory"] = memory.to_json()
    if prefix_cache is not None:
        sections[PREFIX_CACHE_SECTION] = prefix_cache()
    return StandaloneStatus(
        standalone=StandaloneServer(
            api_url=api_url,
            serving=ServingStatus.of(announcement),
            capacity=CapacityStatus.of(announcement),
            load=LoadStatus.of(announcement),
            uptime_s=round(time.monotonic() - started, 3),
        ),
        sections=sections,
    )


async def answer_standalone_status(
    data_dir: Path,
    api_url: str,
    announcement: mesh.PeerAnnouncement,
    prefix_cache: SectionProvider | None = None,
) -> StatusServer | None:
    """Answer ``meshnode status`` on ``data_dir`` for this server (meshnode.statussocket.standalone)."""
    started = time.monotonic()
    return await answer_status(
        data_dir, lambda: standalone_status(api_url, announcement, started, prefix_cache), "server"
    )


__all__ = ["StandaloneServer", "StandaloneStatus", "answer_standalone_status", "standalone_status"]
