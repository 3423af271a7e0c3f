"""``meshnode status`` and ``meshnode generate`` for a ``meshnode serve`` process.

A server of one has no mesh, but a person who started it asks it the same
questions as a node: what it serves, how busy it is, its memory, and where its
API is. Its data directory's status socket answers them, as a node's does,
unless something already answers there: a node owns its directory (it holds the
directory's lock), so a server started beside it leaves the socket to the node,
and a node started later on the server's directory takes the socket over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engines.resident_memory import shard_memory
from meshnode.app.status import query_status
from meshnode.membership.store import DataDir
from meshnode.node.status_report import CapacityStatus, LoadStatus, ServingStatus
from meshnode.node.status_server import StatusServer
from meshnode.wire.pb import mesh

log = logging.getLogger("meshnode.cli")


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
    ``node``, no peers, and the node's ``memory`` section."""

    standalone: StandaloneServer
    sections: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def standalone_status(api_url: str, announcement: mesh.PeerAnnouncement, started: float) -> StandaloneStatus:
    """What the server says of itself now; ``announcement`` is what its shard service keeps up to date
    (serving, capacity, load: meshnode.head.environment.StandaloneShardHost)."""
    memory = shard_memory()
    return StandaloneStatus(
        standalone=StandaloneServer(
            api_url=api_url,
            serving=ServingStatus.of(announcement),
            capacity=CapacityStatus.of(announcement),
            load=LoadStatus.of(announcement),
            uptime_s=round(time.monotonic() - started, 3),
        ),
        sections={"memory": memory.to_json()} if memory is not None and memory.budget.total_bytes else {},
    )


async def answer_status(
    data_dir: Path, api_url: str, announcement: mesh.PeerAnnouncement
) -> StatusServer | None:
    """Answer ``meshnode status`` on ``data_dir``'s socket for this server (close it when done);
    ``None`` where a node already answers there."""
    try:
        await asyncio.to_thread(query_status, data_dir, 1.0)
    except OSError:
        pass  # nobody answers: the socket, if any, is a leftover
    else:
        log.info(
            "`meshnode status` and `generate` on %s answer for the node running there, not this server "
            "(give serve a --data-dir of its own to ask it)",
            data_dir,
        )
        return None
    started = time.monotonic()
    server = StatusServer(
        DataDir(data_dir).control_socket, lambda: standalone_status(api_url, announcement, started)
    )
    await server.start()
    return server


__all__ = ["StandaloneServer", "StandaloneStatus", "answer_status", "standalone_status"]
