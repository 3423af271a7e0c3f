"""A node's status as a typed value: this node, each peer it lists, and what it refused.

:meth:`StatusReport.to_json` is what the status socket serves and ``meshnode
status --json`` prints; scripts, tests and :mod:`meshnode.app.status` read its
keys, which are these classes' field names in this order, so renaming a field
changes the format. Node ids are hex, times are seconds rounded to the
millisecond.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from engines.resident_memory import shard_memory
from meshnode.identity import short_id
from meshnode.mesh.dispatcher import Dispatcher
from meshnode.mesh.peer_table import PeerEntry
from meshnode.mesh.serving_states import serving_state_name
from meshnode.mesh.state import MeshState
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.node.membership_keeper import MembershipKeeper
from meshnode.relaylink.manager import RelayLinks
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import PeerLink
from meshnode.traversal.direct_paths import DirectPaths
from meshnode.traversal.nat_mapping import mapping_name
from meshnode.wire.pb import mesh


@dataclass(frozen=True)
class ServingStatus:
    model: str
    start_layer: int
    end_layer: int
    total_layers: int
    model_digest: str
    numerics: str
    # "serving"; "claimed" while the node fetches and loads the range (routes skip it);
    # "draining" or "not serving" as its load record says.
    state: str = "serving"
    # What a step of the range takes there, ms per token (ServedShard.speed): "calibrated" at load,
    # "measured" from its batches; None and "" from a node that does not say, prefill None until
    # measured.
    decode_ms_per_token: float | None = None
    prefill_ms_per_token: float | None = None
    speed_source: str = ""
    speed_samples: int = 0

    @classmethod
    def of(cls, announcement: mesh.PeerAnnouncement) -> ServingStatus | None:
        """What ``announcement`` says its node serves (``None``: nothing)."""
        if not announcement.HasField("serving"):
            return None
        serving = announcement.serving
        return cls(
            model=serving.model_name,
            start_layer=serving.shard_range.start_layer,
            end_layer=serving.shard_range.end_layer,
            total_layers=serving.total_layers,
            model_digest=serving.fingerprint.model_artifact_digest,
            numerics=serving.numerics,
            state=serving_state_name(announcement),
            **_speed_fields(serving),
        )


# How an announced speed was obtained, as status shows it (validated: no other source arrives).
_SPEED_SOURCES = {
    mesh.STAGE_SPEED_SOURCE_CALIBRATED: "calibrated",
    mesh.STAGE_SPEED_SOURCE_MEASURED: "measured",
    mesh.STAGE_SPEED_SOURCE_ESTIMATED: "estimated",
}


def _speed_fields(serving: mesh.ServedShard) -> dict[str, Any]:
    if not serving.HasField("speed"):
        return {}
    speed = serving.speed
    return {
        "decode_ms_per_token": speed.decode_us_per_token / 1_000,
        "prefill_ms_per_token": speed.prefill_us_per_token / 1_000 if speed.prefill_us_per_token else None,
        "speed_source": _SPEED_SOURCES.get(speed.source, "calibrated"),
        "speed_samples": speed.samples,
    }


@dataclass(frozen=True)
class RelayStatus:
    """One of this node's relays."""

    id: str
    address: str
    registered: bool
    # Why the last registration attempt failed or the connection ended ("" while registered).
    problem: str = ""


@dataclass(frozen=True)
class AnnouncedRelay:
    """A relay a peer announces it can be reached through."""

    id: str
    address: str


@dataclass(frozen=True)
class CapacityStatus:
    max_concurrent_sessions: int
    max_context_tokens: int

    @classmethod
    def of(cls, announcement: mesh.PeerAnnouncement) -> CapacityStatus:
        return cls(
            max_concurrent_sessions=announcement.capacity.max_concurrent_sessions,
            max_context_tokens=announcement.capacity.max_context_tokens,
        )


@dataclass(frozen=True)
class LoadStatus:
    active_sessions: int
    queued_chunks: int
    kv_pressure: float

    @classmethod
    def of(cls, announcement: mesh.PeerAnnouncement) -> LoadStatus:
        return cls(
            active_sessions=announcement.load.active_sessions,
            queued_chunks=announcement.load.queued_chunks,
            kv_pressure=round(announcement.load.kv_pressure, 4),
        )


@dataclass(frozen=True)
class NodeStatus:
    id: str
    short_id: str
    mesh_id: str
    member: bool
    addresses: list[str]
    directly_reachable: bool
    relays: list[RelayStatus]
    incarnation: int
    heartbeat_seq: int
    serving: ServingStatus | None
    uptime_s: float
    # Where this node's OpenAI-compatible API listens (None: no API here).
    api_url: str | None
    # What this node announces of its own shard (zero while it serves none).
    capacity: CapacityStatus
    load: LoadStatus
    # Where this node's relays see its socket, what that says of its NAT ("endpoint-independent",
    # "endpoint-dependent", "no NAT", "unknown"), and whether it punches ("on"/"off").
    observed_addresses: list[str] = field(default_factory=list)
    nat_mapping: str = "unknown"
    hole_punching: str = "off"


@dataclass(frozen=True)
class PeerStatus:
    id: str
    short_id: str
    role: str
    addresses: list[str]
    directly_reachable: bool
    relays: list[AnnouncedRelay]
    serving: ServingStatus | None
    capacity: CapacityStatus
    load: LoadStatus
    # The live link's transport and address (None: no link now).
    link: str | None
    admitted: bool
    # Since a fresher announcement of the peer arrived, and since the peer itself last gossiped.
    age_s: float
    last_direct_s: float | None
    incarnation: int
    heartbeat_seq: int
    version: str
    # How the live link goes: "relayed", or direct: "public", "lan", "punched" (None: no link);
    # since when (seconds ago); and the sealed bytes relays carried to and from the peer, ever.
    path: str | None = None
    path_since_s: float | None = None
    relay_bytes: int = 0


@dataclass(frozen=True)
class Refusals:
    """Counts by reason: streams the dispatcher refused, gossip frames, and gossiped records dropped."""

    streams: dict[str, int]
    gossip: dict[str, int]
    records: dict[str, int]


@dataclass(frozen=True)
class StatusReport:
    node: NodeStatus
    peers: list[PeerStatus]
    tombstones: int
    refusals: Refusals
    # Sections other parts of the node add by name (e.g. "placement": a model transfer's progress).
    sections: dict[str, Any] = field(default_factory=dict)
    # Admins, members' certificate expiry, removals (meshnode.node.membership_keeper.status_json).
    membership: dict[str, Any] = field(default_factory=dict)
    # Audit evidence this node holds, each verified (meshnode.audit.evidence_book.to_json): whom it
    # convicts, who reported it, its digest; and the reports refused, by code.
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The status socket's JSON object."""
        return asdict(self)


def _seconds_since(then_ns: int, now_ns: int) -> float:
    return round((now_ns - then_ns) / SECOND_NS, 3)


def _relays(links: RelayLinks | None) -> list[RelayStatus]:
    if links is None:
        return []
    statuses = []
    for endpoint in links.relays:
        client = links.client(endpoint.id)
        registered = client is not None and client.registered
        problem = "" if registered or client is None else client.last_error
        statuses.append(
            RelayStatus(
                id=endpoint.id.hex(), address=endpoint.address, registered=registered, problem=problem
            )
        )
    return statuses


def _peer(
    entry: PeerEntry,
    link: PeerLink | None,
    *,
    admitted: bool,
    now_ns: int,
    traversal: DirectPaths | None,
    relay_bytes: int,
) -> PeerStatus:
    announcement = entry.announcement
    last_direct_ns = entry.last_direct_ns
    path = since = None
    if link is not None:
        path = (
            traversal.path_of(link).value
            if traversal is not None
            else ("relayed" if link.relay_id else "public")
        )
        # The event loop's clock is the monotonic one (asyncio's and uvloop's both).
        since = round(max(0.0, now_ns / SECOND_NS - link.established_at), 3)
    return PeerStatus(
        id=entry.peer_id.hex(),
        short_id=short_id(entry.peer_id),
        role=mesh.NodeRole.Name(announcement.role),
        addresses=list(announcement.addresses),
        directly_reachable=announcement.directly_reachable,
        relays=[AnnouncedRelay(id=r.relay_id.hex(), address=r.address) for r in announcement.relays],
        serving=ServingStatus.of(announcement),
        capacity=CapacityStatus.of(announcement),
        load=LoadStatus.of(announcement),
        link=link.description if link is not None else None,
        admitted=admitted,
        age_s=_seconds_since(entry.last_heard_ns, now_ns),
        last_direct_s=_seconds_since(last_direct_ns, now_ns) if last_direct_ns is not None else None,
        incarnation=announcement.incarnation,
        heartbeat_seq=announcement.heartbeat_seq,
        version=announcement.version,
        path=path,
        path_since_s=since,
        relay_bytes=relay_bytes,
    )


def status_report(
    state: MeshState,
    *,
    relays: RelayLinks | None,
    link_to: Callable[[bytes], PeerLink | None],
    stream_refusals: Mapping[str, int],
    gossip_refusals: Mapping[str, int],
    started_at_ns: int,
    api_url: str | None,
    now_ns: int,
    membership: dict[str, Any] | None = None,
    traversal: DirectPaths | None = None,
    evidence: dict[str, Any] | None = None,
) -> StatusReport:
    """The report of the node whose membership state is ``state``, at ``now_ns``.

    ``now_ns`` and ``started_at_ns`` are monotonic, the clock the peer table keeps its times on.

    ``link_to(peer_id)``: the live link to a peer, or ``None``.
    """
    local = state.local
    node = NodeStatus(
        id=state.node_id.hex(),
        short_id=short_id(state.node_id),
        mesh_id=state.mesh_id,
        member=state.is_member,
        addresses=list(local.addresses),
        directly_reachable=local.directly_reachable,
        relays=_relays(relays),
        incarnation=local.incarnation,
        heartbeat_seq=local.heartbeat_seq,
        serving=ServingStatus.of(local),
        uptime_s=_seconds_since(started_at_ns, now_ns),
        api_url=api_url,
        capacity=CapacityStatus.of(local),
        load=LoadStatus.of(local),
        observed_addresses=list(local.observed_addresses),
        nat_mapping=mapping_name(local.nat_mapping),
        hole_punching="on" if traversal is not None and traversal.enabled else "off",
    )
    relayed = relays.stats.peer_bytes if relays is not None else {}
    sections: dict[str, Any] = {}
    peers = [
        _peer(
            entry,
            link_to(entry.peer_id),
            admitted=state.is_admitted(entry.peer_id),
            now_ns=now_ns,
            traversal=traversal,
            relay_bytes=relayed.get(entry.peer_id, 0),
        )
        for entry in state.table.entries()
    ]
    if traversal is not None:
        sections["traversal"] = traversal.status_json()
    # Resident memory against the budget of the shards this process loaded (engines.resident_memory):
    # the engine runs in the node's process. Absent while it holds none.
    memory = shard_memory()
    if memory is not None and memory.budget.total_bytes:
        sections["memory"] = memory.to_json()
    return StatusReport(
        node=node,
        peers=peers,
        tombstones=state.table.tombstone_count,
        refusals=Refusals(
            streams=dict(stream_refusals), gossip=dict(gossip_refusals), records=dict(state.record_drops)
        ),
        membership=membership or {},
        sections=sections,
        evidence=evidence or {},
    )


class RunningNode(Protocol):
    """What :func:`node_status` reads of a running node (:class:`meshnode.node.runtime.Node`,
    which imports this module for its ``status``: named by its parts here, so neither module
    imports the other both ways)."""

    @property
    def state(self) -> MeshState: ...
    @property
    def relay_links(self) -> RelayLinks | None: ...
    @property
    def dispatcher(self) -> Dispatcher: ...
    @property
    def gossip_refusals(self) -> Mapping[str, int]: ...
    @property
    def started_at_ns(self) -> int: ...
    @property
    def api_url(self) -> str | None: ...
    @property
    def keeper(self) -> MembershipKeeper: ...
    @property
    def traversal(self) -> DirectPaths: ...
    @property
    def evidence(self) -> EvidenceKeeper: ...
    @property
    def status_sections(self) -> Mapping[str, Callable[[], dict[str, Any]]]: ...

    def link_to(self, peer_id: bytes) -> PeerLink | None: ...


def node_status(node: RunningNode) -> StatusReport:
    """A running node's report now (``Node.status``), the sections its parts add included."""
    report = status_report(
        node.state,
        relays=node.relay_links,
        link_to=node.link_to,
        stream_refusals=node.dispatcher.refusals,
        gossip_refusals=node.gossip_refusals,
        started_at_ns=node.started_at_ns,
        api_url=node.api_url,
        now_ns=time.monotonic_ns(),
        membership=node.keeper.status_json(),
        traversal=node.traversal,
        evidence=node.evidence.status_json(),
    )
    report.sections.update({name: section() for name, section in node.status_sections.items()})
    return report


__all__ = [
    "AnnouncedRelay",
    "CapacityStatus",
    "LoadStatus",
    "NodeStatus",
    "PeerStatus",
    "Refusals",
    "RelayStatus",
    "RunningNode",
    "ServingStatus",
    "StatusReport",
    "node_status",
    "status_report",
]
