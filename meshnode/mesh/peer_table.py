"""The node's view of the mesh: one entry per known peer, plus tombstones. Pure; time is a parameter.

Only verified records are merged (:mod:`meshnode.mesh.signed_record`), and each
entry keeps the signed bytes it came from, which is what gossip relays. Every time
here is monotonic nanoseconds (``now_ns``, :mod:`meshnode.sansio`): how long a peer
has been quiet, or a tombstone has lived, is a span on this machine, which a step of
the wall clock must neither stretch nor end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from meshnode.mesh.gossip_records import DroppedRecord
from meshnode.mesh.rules import Freshness, MergeAction, resolve_announcement
from meshnode.mesh.signed_record import VerifiedRecord
from meshnode.wire.pb import mesh


def freshness(announcement: mesh.PeerAnnouncement) -> Freshness:
    return Freshness(announcement.incarnation, announcement.heartbeat_seq)


@dataclass
class PeerEntry:
    announcement: mesh.PeerAnnouncement
    # The peer's own signed bytes of `announcement`, relayed unchanged.
    record: mesh.SignedPeerRecord
    first_seen_ns: int
    # When a fresher announcement of this peer last arrived (from anyone).
    last_heard_ns: int
    # When the peer itself last gossiped with us; None if only heard about.
    last_direct_ns: int | None = None

    @property
    def peer_id(self) -> bytes:
        return bytes(self.announcement.endpoint_id)


@dataclass(frozen=True)
class Tombstone:
    freshness: Freshness
    expires_at_ns: int
    reason: str
    # Removed on this node's own failed probes (SWIM's confirmation), not because it left: if it
    # talks to us it was alive after all, and it may refute the removal with a fresher record
    # (MeshState.removed_as_down).
    refutable: bool = False


@dataclass
class MergeReport:
    added: list[bytes] = field(default_factory=list)
    updated: list[bytes] = field(default_factory=list)
    ignored_tombstoned: list[bytes] = field(default_factory=list)
    ignored_full: list[bytes] = field(default_factory=list)
    # Records of the frame refused before the merge (unsigned, forged, ...).
    dropped: list[DroppedRecord] = field(default_factory=list)


# The most peers a table holds unless configured otherwise (NodeConfig.max_peers). Twice the
# 1,024 members the membership is built and measured for (bench/scale.py, issue 57): a mesh at
# that size still has room to grow, while what the bound is for stays small: a member can sign
# records for as many made-up node ids as it likes, and each record held costs about 3 KB
# (bench/scale.py's memory per member at 1,024), so at most about 6 MB, and a route's planning
# (linear in the table, 11.6 ms at 1,024 on the loaded bench machine) stays within tens of ms.
DEFAULT_MAX_PEERS = 2048


class PeerTable:
    def __init__(
        self,
        self_id: bytes,
        *,
        tombstone_ttl_ns: int,
        max_peers: int = DEFAULT_MAX_PEERS,
        max_departed: int = 64,
    ) -> None:
        self.self_id = self_id
        self.tombstone_ttl_ns = tombstone_ttl_ns
        self.max_peers = max_peers
        self.max_departed = max_departed
        self._entries: dict[bytes, PeerEntry] = {}
        self._tombstones: dict[bytes, Tombstone] = {}
        # Where removed peers last said they listen, the latest removal last; unlike a tombstone
        # it does not expire (a member that stopped may come back there), only the oldest goes.
        self._departed: dict[bytes, str] = {}
        # Bumped whenever an entry is added, updated or removed: a summary of the table computed
        # at one count is still right while the count is unchanged (delta gossip's digests).
        self.changes = 0

    def __contains__(self, peer_id: bytes) -> bool:
        return peer_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer_id: bytes) -> PeerEntry | None:
        return self._entries.get(peer_id)

    def record_of(self, peer_id: bytes) -> mesh.SignedPeerRecord | None:
        entry = self._entries.get(peer_id)
        return entry.record if entry is not None else None

    def announcement_of(self, peer_id: bytes) -> mesh.PeerAnnouncement | None:
        entry = self._entries.get(peer_id)
        return entry.announcement if entry is not None else None

    def entries(self) -> list[PeerEntry]:
        return list(self._entries.values())

    def peer_ids(self) -> list[bytes]:
        return list(self._entries)

    def tombstoned_ids(self) -> list[bytes]:
        return list(self._tombstones)

    def tombstone(self, peer_id: bytes) -> Tombstone | None:
        return self._tombstones.get(peer_id)

    def departed(self) -> list[tuple[bytes, str]]:
        """Removed peers not listed again, with the first address they last announced, the
        latest removal first."""
        return list(reversed(self._departed.items()))

    @property
    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def merge(self, records: Iterable[VerifiedRecord], *, from_peer: bytes, now_ns: int) -> MergeReport:
        """Merge gossip received from ``from_peer``; freshness is what each signer says."""
        self.expire_tombstones(now_ns)
        report = MergeReport()
        for record in records:
            announcement = record.announcement
            peer_id = record.node_id
            entry = self._entries.get(peer_id)
            tombstone = self._tombstones.get(peer_id)
            direct = peer_id == from_peer
            action = resolve_announcement(
                incoming=freshness(announcement),
                current=freshness(entry.announcement) if entry else None,
                tombstone=tombstone.freshness if tombstone else None,
                is_self=peer_id == self.self_id,
                direct=direct,
            )
            if action is MergeAction.ADD and len(self._entries) >= self.max_peers:
                report.ignored_full.append(peer_id)
            elif action is MergeAction.ADD:
                copy = mesh.PeerAnnouncement()
                copy.CopyFrom(announcement)
                self.changes += 1
                self._entries[peer_id] = PeerEntry(
                    copy, record.signed, first_seen_ns=now_ns, last_heard_ns=now_ns
                )
                self._tombstones.pop(peer_id, None)
                self._departed.pop(peer_id, None)
                report.added.append(peer_id)
            elif action is MergeAction.UPDATE:
                assert entry is not None
                entry.announcement.CopyFrom(announcement)
                entry.record = record.signed
                self.changes += 1
                entry.last_heard_ns = now_ns
                report.updated.append(peer_id)
            elif action is MergeAction.IGNORE_TOMBSTONED:
                report.ignored_tombstoned.append(peer_id)
            entry = self._entries.get(peer_id)
            if direct and entry is not None:
                entry.last_direct_ns = now_ns
        return report

    def remove(self, peer_id: bytes, *, reason: str, now_ns: int, refutable: bool = False) -> bool:
        """Drop a peer and tombstone its last known state; false if it was not known.
        ``refutable``: see :attr:`Tombstone.refutable`."""
        entry = self._entries.pop(peer_id, None)
        if entry is None:
            return False
        self.changes += 1
        self._tombstones[peer_id] = Tombstone(
            freshness(entry.announcement), now_ns + self.tombstone_ttl_ns, reason, refutable
        )
        self._departed.pop(peer_id, None)  # re-inserted last: departed() is in removal order
        if entry.announcement.addresses:
            self._departed[peer_id] = entry.announcement.addresses[0]
            while len(self._departed) > self.max_departed:
                del self._departed[next(iter(self._departed))]
        return True

    def expire_tombstones(self, now_ns: int) -> None:
        for peer_id in [p for p, t in self._tombstones.items() if t.expires_at_ns <= now_ns]:
            del self._tombstones[peer_id]

    def stale(self, *, now_ns: int, timeout_ns: int) -> list[bytes]:
        """Peers with no fresher announcement for longer than ``timeout_ns``."""
        return [p for p, e in self._entries.items() if now_ns - e.last_heard_ns > timeout_ns]


__all__ = ["DEFAULT_MAX_PEERS", "MergeReport", "PeerEntry", "PeerTable", "Tombstone", "freshness"]
