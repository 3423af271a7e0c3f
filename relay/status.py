"""``meshnode status`` for a running relay: who is registered, what it forwarded and refused.

The relay's data directory's status socket answers it (meshnode.statussocket.standalone),
so an operator asks a relay as they ask a node: ``meshnode status --data-dir
RELAY_DIR``. The figures are the ones ``--metrics-listen`` serves to Prometheus,
read from the relay at the time of asking.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshnode.identity import short_id
from meshnode.statussocket.server import StatusServer
from meshnode.statussocket.standalone import answer_status
from meshnode.transport.addresses import format_host_port
from relay.server import RelayServer


@dataclass(frozen=True)
class RegisteredMember:
    id: str
    short_id: str
    mesh_id: str
    # Where it connects from, as the relay sees it (a NATed member's router).
    address: str
    queued_bytes: int


@dataclass(frozen=True)
class RelayProcess:
    id: str
    short_id: str
    address: str
    meshes: list[str]
    uptime_s: float
    members: list[RegisteredMember]
    connections: int
    unregistered: int
    registrations: int
    frames_forwarded: int
    bytes_forwarded: int
    queued_bytes: int
    queued_bytes_limit: int
    # By RelayErrorCode name.
    frames_refused: dict[str, int]
    connections_refused: dict[str, int]
    metrics_url: str | None


@dataclass(frozen=True)
class RelayStatus:
    """The status socket's answer for a relay: ``relay`` in place of a node's ``node``."""

    relay: RelayProcess

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def relay_status(server: RelayServer, started: float, metrics_url: str | None) -> RelayStatus:
    core, stats = server.core, server.core.stats
    addresses = server.member_addresses()
    members = [
        RegisteredMember(
            node_id.hex(),
            short_id(node_id),
            mesh_id,
            addresses.get(node_id, "?"),
            core.queued_bytes_for(node_id),
        )
        for node_id, mesh_id in core.registered_members()
    ]
    return RelayStatus(
        relay=RelayProcess(
            id=server.relay_id.hex(),
            short_id=short_id(server.relay_id),
            address=format_host_port(*server.address),
            meshes=sorted(core.meshes),
            uptime_s=round(time.monotonic() - started, 3),
            members=sorted(members, key=lambda member: (member.mesh_id, member.short_id)),
            connections=stats.connections,
            unregistered=stats.unregistered,
            registrations=stats.registrations,
            frames_forwarded=stats.frames_forwarded,
            bytes_forwarded=stats.bytes_forwarded,
            queued_bytes=stats.queued_bytes,
            queued_bytes_limit=server.policy.total_queue_bytes,
            frames_refused=dict(stats.refused_frames),
            connections_refused=dict(stats.connections_refused),
            metrics_url=metrics_url,
        )
    )


async def answer_relay_status(
    data_dir: Path, server: RelayServer, metrics_url: str | None
) -> StatusServer | None:
    """Answer ``meshnode status`` on the relay's data directory (None: another process does)."""
    started = time.monotonic()
    return await answer_status(data_dir, lambda: relay_status(server, started, metrics_url), "relay")


__all__ = ["RegisteredMember", "RelayProcess", "RelayStatus", "answer_relay_status", "relay_status"]
