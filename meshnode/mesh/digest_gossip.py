"""Bounded delta gossip between admitted members: a digest first, then only what differs.

Today's GossipFrame carries the whole table on every exchange; here an exchange
between two members (Cassandra's digest-then-pull, with Merkle-style buckets) is
four frames on one stream, none of which needs the whole table:

1. the opener's :class:`~meshnode.wire.pb.mesh.DigestOpen`: its table (its own record
   included) split into ``bucket_count`` buckets by node id, each bucket's hash (the
   XOR of a hash of each record's node id, incarnation and sequence) sent as a 16-bit
   tag under a salt drawn for the exchange, and a summary of its revocations;
2. the responder's ``DigestReply``: for the buckets whose tag differs, its own
   versions (a 4-byte prefix of the node id, a 16-bit tag of the incarnation under the
   same salt, the sequence), whole buckets up to ``MAX_DIGEST_ENTRIES_PER_FRAME``,
   starting at a rotating bucket so a large difference is covered over successive
   rounds; and its revocation ids when the revocation summaries differ;
3. the opener's ``DigestPush``: the records it holds fresher than the responder's
   (or that the responder lacks in a listed bucket), the node ids whose record the
   responder holds fresher, and likewise for revocations;
4. the responder's ``DigestRecords``: the records and revocations asked for.

A digest is a hint, not a claim anyone relies on: it only chooses what to send.
Every record still travels as its subject signed it and is verified on receipt,
and revocations are verified by the mesh's admins' keys
(:meth:`~meshnode.mesh.state.MeshState.merge_relayed`,
:meth:`~meshnode.mesh.state.MeshState.learn_revocations`): the signed-record and
revocation rules are the full gossip's. A peer that lies in its digest can make
us send what it already holds, or not receive what it would not send anyway.

Both sides must be admitted already (the first exchange with a peer is a full
GossipFrame, which carries the membership proof). Pure and synchronous, like
:class:`~meshnode.mesh.state.MeshState`; its asyncio edge sends what it returns.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.mesh.peer_table import MergeReport
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import (
    DIGEST_PREFIX_BYTES,
    DIGEST_TAG_BYTES,
    MAX_DIGEST_BUCKETS,
    MAX_DIGEST_ENTRIES_PER_FRAME,
    MAX_PEERS_PER_FRAME,
    MAX_WANTED_PER_FRAME,
    validate_digest_open,
    validate_digest_push,
    validate_digest_records,
    validate_digest_reply,
)
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

# About this many records per bucket: a changed record makes the responder list its bucket,
# so the fewer per bucket the smaller the reply, and the more buckets the larger the summary
# (2 bytes each). Eight balances them: at 1,024 nodes a summary is 256 bytes and a bucket's
# versions about 65.
RECORDS_PER_BUCKET = 8

_MASK64 = (1 << 64) - 1

Version = tuple[int, int]


def record_version(announcement: mesh.PeerAnnouncement) -> Version:
    """What orders a node's records: its incarnation, then its sequence (the rules' freshness)."""
    return (announcement.incarnation, announcement.heartbeat_seq)


def version_hash(node_id: bytes, version: Version) -> int:
    incarnation, sequence = version
    data = node_id + incarnation.to_bytes(8, "big", signed=True) + sequence.to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "big")


def tag_of(value: int, salt: int) -> int:
    """``value``'s 16-bit tag under ``salt``: the top bits of a multiply-shift hash (Dietzfelbinger
    et al.), so for a random salt two different values tag alike about once in 2^15. A digest
    sends tags, not values, where a collision only makes two members miss a difference until
    their next exchange, which draws another salt."""
    return (((value & _MASK64) * (salt | 1)) & _MASK64) >> 48


def _tag_bytes(value: int, salt: int) -> bytes:
    return tag_of(value, salt).to_bytes(DIGEST_TAG_BYTES, "big")


def revocation_id(revocation: membership.Revocation) -> int:
    return int.from_bytes(
        hashlib.blake2b(revocation.body + revocation.signature, digest_size=8).digest(), "big"
    )


def prefix_of(node_id: bytes) -> bytes:
    """How a digest names a node: the first 4 bytes of its id. Ids are public keys, so two
    members sharing a prefix is chance (about one pair in 8,000 meshes of 1,024) or a key
    ground for it; either way both records are sent, and each is still verified against its
    own full id."""
    return node_id[:DIGEST_PREFIX_BYTES]


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def bucket_of(node_id: bytes, bucket_count: int) -> int:
    """Node ids are public keys, uniform enough that their first bytes spread the buckets evenly."""
    return int.from_bytes(node_id[:4], "big") % bucket_count


def bucket_count_for(records: int) -> int:
    """The power of two nearest above ``records / RECORDS_PER_BUCKET``, within 1..MAX_DIGEST_BUCKETS."""
    count = 1
    while count * RECORDS_PER_BUCKET < records and count < MAX_DIGEST_BUCKETS:
        count *= 2
    return count


@dataclass
class _Buckets:
    hashes: list[int]
    members: list[list[bytes]]


@dataclass
class _Snapshot:
    """Our versions at one state of the table, and their buckets at the counts asked for."""

    key: tuple[int, int, Version]
    versions: dict[bytes, Version]
    # Nodes we removed (tombstoned) or that were revoked, by prefix: not asked for again.
    removed: dict[bytes, bytes]
    _by_count: dict[int, _Buckets] = field(default_factory=dict)
    _by_prefix: dict[bytes, list[bytes]] | None = None

    def named(self, prefix: bytes) -> list[bytes]:
        """Our nodes whose id begins with ``prefix`` (one, but for a collision)."""
        if self._by_prefix is None:
            self._by_prefix = {}
            for node_id in self.versions:
                self._by_prefix.setdefault(prefix_of(node_id), []).append(node_id)
        return self._by_prefix.get(prefix, [])

    def buckets(self, bucket_count: int) -> _Buckets:
        buckets = self._by_count.get(bucket_count)
        if buckets is None:
            hashes = [0] * bucket_count
            members: list[list[bytes]] = [[] for _ in range(bucket_count)]
            for node_id, version in self.versions.items():
                bucket = bucket_of(node_id, bucket_count)
                hashes[bucket] ^= version_hash(node_id, version)
                members[bucket].append(node_id)
            buckets = self._by_count[bucket_count] = _Buckets(hashes, members)
        return buckets


# A version as a DigestReply lists it: its incarnation's tag and its sequence.
_Listed = tuple[int, int]


def _fresher_here(ours: Version, listed: list[_Listed] | None, salt: int) -> bool:
    """Whether to push our record against what the peer listed under its prefix: it lacks it,
    holds an older sequence of the same incarnation, or another incarnation (the merge orders
    two incarnations; the peer may hold the newer, and then ignores ours). Two listed under one
    prefix (a collision): pushed, so neither is missed."""
    if not listed or len(listed) > 1:
        return True
    tag, sequence = listed[0]
    if tag == tag_of(ours[0], salt):
        return ours[1] > sequence
    return True


def _fresher_there(held: Version, listed: list[_Listed], salt: int) -> bool:
    """Whether to ask for the peer's record of a node we hold at ``held``: a newer sequence of
    our incarnation, or another incarnation (or two listed under one prefix)."""
    if len(listed) > 1:
        return True
    tag, sequence = listed[0]
    if tag == tag_of(held[0], salt):
        return held[1] < sequence
    return True


@dataclass
class DigestExchangeReport:
    """What one side of an exchange took in."""

    merged: MergeReport = field(default_factory=MergeReport)
    revocations_learned: int = 0


class DigestGossip:
    """The delta gossip of one node, over its :class:`MeshState` (the table, its own record and the
    revocations it holds). ``rng`` picks the bucket a reply starts at."""

    def __init__(self, state: MeshState, *, rng: random.Random | None = None) -> None:
        self._state = state
        self._rng = rng or random.Random()
        self._snapshot: _Snapshot | None = None

    # -- our versions --------------------------------------------------------------------

    def versions(self) -> dict[bytes, Version]:
        """Every record we hold, our own included, by node id."""
        return self._current().versions

    def _current(self) -> _Snapshot:
        """Our versions, recomputed only when the table or our own record changed: an exchange
        reads them three times, and a member takes part in several exchanges a round."""
        state = self._state
        key = (state.table.changes, len(state.revocations), state.local_version())
        if self._snapshot is None or self._snapshot.key != key:
            versions = {entry.peer_id: record_version(entry.announcement) for entry in state.table.entries()}
            versions[state.node_id] = key[2]
            removed = [
                *state.table.tombstoned_ids(),
                *(r.target for r in state.revocations.all() if r.kind == "node"),
            ]
            self._snapshot = _Snapshot(key, versions, {prefix_of(n): n for n in removed})
        return self._snapshot

    def _bucket_hashes(self, bucket_count: int) -> list[int]:
        return self._current().buckets(bucket_count).hashes

    def _revocation_ids(self) -> dict[int, membership.Revocation]:
        return {revocation_id(r): r for r in self._state.revocations.signed()}

    def _record(self, node_id: bytes) -> mesh.SignedPeerRecord | None:
        if node_id == self._state.node_id:
            return self._state.local_record()
        return self._state.table.record_of(node_id)

    def _check_peer(self, peer_id: bytes) -> None:
        # Revoked first: a removed node is told why, not only that it is not admitted.
        self._state.gate.check_not_revoked(peer_id)
        if not self._state.is_admitted(peer_id):
            raise MeshRefusal(mesh.MESH_ERROR_NOT_ADMITTED, "delta gossip needs a full exchange first")

    # -- the opener --------------------------------------------------------------------------

    def open(self) -> mesh.DigestOpen:
        """Step 1: our summary."""
        count = bucket_count_for(len(self.versions()))
        salt = self._rng.getrandbits(64)
        revocations = self._revocation_ids()
        summary = 0
        for rid in revocations:
            summary ^= rid
        return mesh.DigestOpen(
            gen=NODE_PROTOCOL_GENERATION,
            sender_id=self._state.node_id,
            bucket_count=count,
            bucket_tags=b"".join(_tag_bytes(h, salt) for h in self._bucket_hashes(count)),
            salt=salt,
            revocation_count=len(revocations),
            revocation_hash=summary,
        )

    def answer_reply(
        self, sent: mesh.DigestOpen, reply: mesh.DigestReply, *, peer_id: bytes
    ) -> mesh.DigestPush:
        """Step 3: what the responder's versions say it lacks, and what we want of its."""
        validate_digest_reply(reply, peer_id, sent.bucket_count)
        self._check_peer(peer_id)
        snapshot = self._current()
        ours = snapshot.versions
        salt = sent.salt
        theirs: dict[bytes, list[_Listed]] = {}
        tags = _chunks(reply.incarnation_tags, DIGEST_TAG_BYTES)
        prefixes = _chunks(reply.node_prefixes, DIGEST_PREFIX_BYTES)
        for prefix, tag, sequence in zip(prefixes, tags, reply.sequences, strict=True):
            theirs.setdefault(prefix, []).append((int.from_bytes(tag, "big"), sequence))
        push = mesh.DigestPush(gen=NODE_PROTOCOL_GENERATION, sender_id=self._state.node_id)
        members = snapshot.buckets(sent.bucket_count).members
        for node_id in (n for bucket in dict.fromkeys(reply.listed_buckets) for n in members[bucket]):
            if len(push.entries) >= MAX_PEERS_PER_FRAME:
                break
            if _fresher_here(ours[node_id], theirs.get(prefix_of(node_id)), salt):
                record = self._record(node_id)
                if record is not None:
                    push.entries.add().record.CopyFrom(record)
        wanted: list[bytes] = []
        for prefix, listed in theirs.items():
            if len(wanted) >= MAX_WANTED_PER_FRAME:
                break
            named = snapshot.named(prefix)
            if not named:
                if self._wants(snapshot.removed.get(prefix), listed, None, peer_id, salt):
                    wanted.append(prefix)
            elif any(self._wants(n, listed, ours[n], peer_id, salt) for n in named):
                wanted.append(prefix)
        push.wanted = b"".join(wanted)
        if reply.revocations_listed:
            held = self._revocation_ids()
            listed_ids = set(reply.revocation_ids)
            missing = [r for rid, r in held.items() if rid not in listed_ids]
            push.revocations.extend(missing[:MAX_WANTED_PER_FRAME])
            push.wanted_revocations.extend(
                [rid for rid in listed_ids if rid not in held][:MAX_WANTED_PER_FRAME]
            )
        return push

    def take_records(
        self, frame: mesh.DigestRecords, *, peer_id: bytes, now_ns: int, unix_now: float
    ) -> DigestExchangeReport:
        """The end of an exchange, on the opener's side: merge what we asked for."""
        validate_digest_records(frame, peer_id)
        self._check_peer(peer_id)
        return self._take(frame.entries, frame.revocations, peer_id, now_ns, unix_now)

    # -- the responder ----------------------------------------------------------------------

    def answer_open(self, frame: mesh.DigestOpen, *, peer_id: bytes) -> mesh.DigestReply:
        """Step 2: our versions in the buckets whose hash differs from the opener's."""
        validate_digest_open(frame, peer_id)
        self._check_peer(peer_id)
        count = frame.bucket_count
        salt = frame.salt
        snapshot = self._current()
        buckets = snapshot.buckets(count)
        their_tags = _chunks(frame.bucket_tags, DIGEST_TAG_BYTES)
        differing = [b for b in range(count) if _tag_bytes(buckets.hashes[b], salt) != their_tags[b]]
        reply = mesh.DigestReply(gen=NODE_PROTOCOL_GENERATION, sender_id=self._state.node_id)
        listing: list[bytes] = []
        start = self._rng.randrange(len(differing)) if differing else 0
        for bucket in differing[start:] + differing[:start]:
            members = buckets.members[bucket]
            if len(listing) + len(members) > MAX_DIGEST_ENTRIES_PER_FRAME:
                if not listing:
                    # One bucket larger than a frame (an opener with a small table summarized
                    # ours in few buckets): a window of it, from a random place, not listed.
                    offset = self._rng.randrange(len(members))
                    listing = (members[offset:] + members[:offset])[:MAX_DIGEST_ENTRIES_PER_FRAME]
                break  # whole buckets only: a bucket listed is one whose absences mean "lacking"
            listing.extend(members)
            reply.listed_buckets.append(bucket)
        versions = [snapshot.versions[node_id] for node_id in listing]
        reply.node_prefixes = b"".join(prefix_of(node_id) for node_id in listing)
        reply.incarnation_tags = b"".join(_tag_bytes(incarnation, salt) for incarnation, _ in versions)
        reply.sequences.extend(sequence for _, sequence in versions)
        revocations = self._revocation_ids()
        summary = 0
        for rid in revocations:
            summary ^= rid
        if summary != frame.revocation_hash or len(revocations) != frame.revocation_count:
            reply.revocations_listed = True
            reply.revocation_ids.extend(sorted(revocations))
        return reply

    def answer_push(
        self, frame: mesh.DigestPush, *, peer_id: bytes, now_ns: int, unix_now: float
    ) -> tuple[mesh.DigestRecords, DigestExchangeReport]:
        """Step 4: merge what the opener pushed, and send what it asked for."""
        validate_digest_push(frame, peer_id)
        self._check_peer(peer_id)
        report = self._take(frame.entries, frame.revocations, peer_id, now_ns, unix_now)
        records = mesh.DigestRecords(gen=NODE_PROTOCOL_GENERATION, sender_id=self._state.node_id)
        snapshot = self._current()
        for prefix in dict.fromkeys(_chunks(frame.wanted, DIGEST_PREFIX_BYTES)):
            for node_id in snapshot.named(prefix):
                if len(records.entries) >= MAX_PEERS_PER_FRAME:
                    break
                record = self._record(node_id)
                if record is not None:
                    records.entries.add().record.CopyFrom(record)
        if frame.wanted_revocations:
            held = self._revocation_ids()
            wanted = dict.fromkeys(frame.wanted_revocations)
            records.revocations.extend(held[rid] for rid in wanted if rid in held)
        return records, report

    # -- both -----------------------------------------------------------------------------------

    def _wants(
        self, node_id: bytes | None, listed: list[_Listed], held: Version | None, peer_id: bytes, salt: int
    ) -> bool:
        """Whether to ask for a record the peer listed; ``node_id`` None: one of a node we do not
        know, of which we know only the prefix (nor its revocation or tombstone: the merge decides)."""
        if node_id is None:
            return True
        if node_id == self._state.node_id or self._state.revocations.node(node_id) is not None:
            return False
        if held is not None:
            return _fresher_there(held, listed, salt)
        tombstone = self._state.table.tombstone(node_id)
        if tombstone is None:
            return True
        # Asked for only when the merge could take it (meshnode.mesh.rules.resolve_announcement):
        # fresher than its tombstone, and a new incarnation or from the node itself.
        dead = (tombstone.freshness.incarnation, tombstone.freshness.heartbeat_seq)
        if len(listed) == 1 and listed[0][0] == tag_of(dead[0], salt):
            return dead[1] < listed[0][1] and node_id == peer_id
        return True

    def _take(
        self,
        entries: Iterable[mesh.GossipEntry],
        revocations: Iterable[membership.Revocation],
        peer_id: bytes,
        now_ns: int,
        unix_now: float,
    ) -> DigestExchangeReport:
        report = DigestExchangeReport()
        revocations = list(revocations)
        if revocations:
            # First: a record of a node these remove must not be merged.
            report.revocations_learned = len(self._state.learn_revocations(revocations, now_ns=now_ns).new)
        report.merged = self._state.merge_relayed(entries, peer_id=peer_id, now_ns=now_ns, unix_now=unix_now)
        return report


__all__ = [
    "RECORDS_PER_BUCKET",
    "DigestExchangeReport",
    "DigestGossip",
    "bucket_count_for",
    "bucket_of",
    "prefix_of",
    "record_version",
    "revocation_id",
    "tag_of",
    "version_hash",
]
