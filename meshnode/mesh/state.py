"""The membership protocol as a synchronous state machine (no I/O, time is a parameter).

:class:`MeshState` holds this node's announcement, its peer table, the set of
admitted peers and its membership credentials. The node runtime feeds it decoded
frames with the transport-authenticated peer id and sends what it returns:

* ``receive_gossip`` — the accepting side of a GOSSIP stream: validate, admit
  (verifying the membership proof of a peer not yet admitted, granting a
  certificate and the mesh key to an invite holder), merge, and build the reply.
* ``receive_gossip_reply`` — the opening side: the same checks on the reply,
  and, while joining, taking the grant that makes this node a member.

Both are one request and its reply on one stream, so they return what the edge
sends back (or raise the :class:`~meshnode.wire.mesh_refusal.MeshRefusal` it sends
instead). Liveness is a timer in the convention of :mod:`meshnode.sansio`: after
``start_heartbeat(now_ns)``, ``handle_timer(now_ns)`` at ``get_timer()`` bumps the
heartbeat and expires tombstones, and ``take_events()`` says what to do about it:
:class:`HeartbeatDue` (gossip with every peer) and a :class:`PeerStale` for each
peer quiet for longer than the peer timeout (probe it).

Two clocks, never mixed: ``now_ns`` is monotonic and times liveness (when a peer
was last heard, a tombstone's end, the next heartbeat), so a step of the wall clock
makes no peer stale and ends no tombstone; ``unix_now`` (wall-clock seconds) is
passed only beside it where a wall-clock instant is read or written: a membership
proof's invite expiry, a record's incarnation bound, a granted certificate's issue time.

Authority (who may join, who was removed, whose certificate expired, what an admin
grants) is :class:`~meshnode.mesh.credential_gate.CredentialGate`'s; this machine
asks it on every frame, carries its revocations on every frame it sends (refusals
included) and says through ``take_new_revocations()`` and ``removed`` what the
node must act on: close the links of removed peers, tell its relays, and exit
when a verified revocation names this node.

Gossip carries signed peer records (:mod:`meshnode.mesh.signed_record`): this
node signs its own announcement with its node key, relays others' records
unchanged, and merges only records that verify against the node they name.
``record_drops`` counts the others, by reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    DEFAULT_CERTIFICATE_TTL_S,
    Endpoint,
    Invite,
    MeshKey,
    certificate_proof,
    issue_certificate,
    make_invite_proof,
    open_grant,
)
from meshnode.membership.revocation import Learned, RevocationList, Revoked
from meshnode.membership.store import MembershipState
from meshnode.mesh.credential_gate import Admission, CredentialGate
from meshnode.mesh.gossip_records import OpenedGossip, open_gossip_entries
from meshnode.mesh.peer_table import DEFAULT_MAX_PEERS, MergeReport, PeerEntry, PeerTable
from meshnode.mesh.signed_record import LocalRecord
from meshnode.mesh.validation import MAX_PEERS_PER_FRAME, validate_gossip_frame
from meshnode.sansio import SECOND_NS
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal
from meshnode.wire.pb import mesh


@dataclass(frozen=True)
class GossipOutcome:
    reply: mesh.GossipFrame
    newly_admitted: bool
    via_invite: bool
    merged: MergeReport
    # The invite (its id) the peer was admitted with, when via_invite.
    invite_id: bytes = b""


@dataclass(frozen=True)
class ReplyOutcome:
    newly_admitted: bool
    joined: bool
    merged: MergeReport
    # An admin renewed our certificate (or promoted us) in this reply.
    renewed: bool = False


@dataclass(frozen=True)
class HeartbeatDue:
    """A heartbeat interval passed: gossip (the announcement's heartbeat_seq is already one higher,
    under ``record_heartbeats=False`` only when its content changed)."""


@dataclass(frozen=True)
class PeerStale:
    """No fresher announcement of ``peer_id`` for longer than the peer timeout; it is dropped only
    once a probe confirms it down. Reported on every heartbeat until it is heard from again or
    removed."""

    peer_id: bytes


MeshEvent = HeartbeatDue | PeerStale


class MeshState:
    def __init__(
        self,
        *,
        identity: NodeIdentity,
        mesh_id: str,
        local: mesh.PeerAnnouncement,
        membership: MembershipState | None,
        invite: Invite | None = None,
        heartbeat_interval_ns: int = 5 * SECOND_NS,
        # Four heartbeats, as the node's default.
        peer_timeout_ns: int = 20 * SECOND_NS,
        tombstone_ttl_ns: int = 60 * SECOND_NS,
        # The most peers the table holds; a new peer beyond it is refused MESH_ERROR_TABLE_FULL
        # (DEFAULT_MAX_PEERS says why the number).
        max_peers: int = DEFAULT_MAX_PEERS,
        revocations: RevocationList | None = None,
        certificate_ttl_s: float = DEFAULT_CERTIFICATE_TTL_S,
        # Records of others a GossipFrame carries besides ours. Under delta gossip
        # (meshnode.mesh.digest_gossip) a frame only admits, and 0 keeps it small.
        frame_table_limit: int = MAX_PEERS_PER_FRAME - 1,
        # Each heartbeat makes our record fresher and a peer not refreshed for the peer timeout is
        # stale: liveness rides on every record. False (delta gossip, where SWIM probes find dead
        # members: meshnode.mesh.failure_detector): our record gets fresher only when its content
        # changed, so a digest finds nothing to send for a record that did not, and no peer is
        # ever reported stale.
        record_heartbeats: bool = True,
        # A GossipFrame carries every revocation we hold. False (delta gossip, whose digests
        # exchange revocations by id): only one naming the frame's receiver, which a removed
        # node needs to see why it is refused; the list only grows, and first contacts are
        # frequent where links follow a partial view.
        frame_revocations: bool = True,
    ) -> None:
        if membership is None and invite is None:
            raise ValueError("a node needs either a membership or an invite")
        self.node_id = identity.node_id
        self.mesh_id = mesh_id
        self.local = local
        self.local.endpoint_id = self.node_id
        self.local.mesh_id = mesh_id
        self._local_record = LocalRecord(identity)
        self.membership = membership
        self.invite = invite
        self.table = PeerTable(self.node_id, tombstone_ttl_ns=tombstone_ttl_ns, max_peers=max_peers)
        self.heartbeat_interval_ns = heartbeat_interval_ns
        self.peer_timeout_ns = peer_timeout_ns
        self._admitted: set[bytes] = set()
        # Gossiped records refused, by RecordFault value ("bad_signature", ...).
        self.record_drops: Counter[str] = Counter()
        # None until start_heartbeat: a state that never heartbeats has no timer.
        self._next_heartbeat_ns: int | None = None
        self._events: list[MeshEvent] = []
        self.frame_table_limit = min(frame_table_limit, MAX_PEERS_PER_FRAME - 1)
        self.record_heartbeats = record_heartbeats
        self.frame_revocations = frame_revocations
        # Under record_heartbeats=False: our announcement's content (its sequence left out) when
        # the sequence last moved, to see whether it changed since.
        self._versioned_content: bytes | None = None
        # Where the next gossip frame's page of a table too large for one frame starts.
        self._page_start = 0
        self.gate = CredentialGate(
            node_id=self.node_id,
            mesh_id=mesh_id,
            revocations=revocations,
            certificate_ttl_s=certificate_ttl_s,
        )
        # Learned since the last take_new_revocations(): the node persists and spreads them.
        self._new_revocations: list[Revoked] = []
        # The verified revocation naming this node, once one arrived: the node must leave.
        self.removed: Revoked | None = self.gate.revocations.node(self.node_id)

    @property
    def is_member(self) -> bool:
        return self.membership is not None

    def is_admitted(self, peer_id: bytes) -> bool:
        return peer_id in self._admitted

    def admitted(self) -> frozenset[bytes]:
        """The peers admitted now (the bulk lane lets their certificates complete a handshake)."""
        return frozenset(self._admitted)

    def heartbeat(self) -> None:
        """Make our announcement fresher, so peers hear from us again."""
        self.local.heartbeat_seq += 1

    @property
    def revocations(self) -> RevocationList:
        return self.gate.revocations

    def take_new_revocations(self) -> list[Revoked]:
        new, self._new_revocations = self._new_revocations, []
        return new

    def learn_revocations(self, revocations: list[membership.Revocation], *, now_ns: int) -> Learned:
        """Verify and apply: a removed peer loses its admission and its table entry at once."""
        learned = self.gate.learn(revocations)
        new = learned.new
        for revoked in new:
            if revoked.kind != "node":
                continue
            if revoked.target == self.node_id:
                self.removed = revoked
            else:
                self.remove_peer(revoked.target, reason=revoked.describe(), now_ns=now_ns)
                self.gate.forget(revoked.target)
        self._new_revocations.extend(new)
        return learned

    def own_certificate_expired(self, unix_now: float) -> bool:
        return self.membership is not None and self.membership.certificate_expired(unix_now)

    def renew_own_certificate(self, unix_now: float) -> bool:
        """An admin renews its own certificate past half its lifetime (nobody else needs to)."""
        ours = self.membership
        if ours is None or ours.mesh_key is None:
            return False
        body = ours.certificate_body
        if unix_now < body.expires_unix - (body.expires_unix - body.issued_unix) / 2:
            return False
        ours.certificate = issue_certificate(
            ours.mesh_key,
            node_id=self.node_id,
            issuer_id=self.node_id,
            unix_now=unix_now,
            ttl_s=self.gate.certificate_ttl_s,
            admin=True,
        )
        return True

    def remove_peer(self, peer_id: bytes, *, reason: str, now_ns: int, refutable: bool = False) -> bool:
        """Drop a peer (left, or confirmed down) and revoke its admission; ``refutable``: removed
        on our own failed probes (SWIM's confirmation), see :meth:`removed_as_down`."""
        self._admitted.discard(peer_id)
        return self.table.remove(peer_id, reason=reason, now_ns=now_ns, refutable=refutable)

    def removed_as_down(self, peer_id: bytes) -> bool:
        """Whether we hold ``peer_id`` removed as confirmed down by our own probes, and not revoked.

        Under delta gossip a removed member's record does not change by itself, so it cannot
        beat its tombstone: a member we confirmed down wrongly (a glitch between us, probes that
        timed out) stays out of our table, alive and serving, until the tombstone expires. A
        peer for which this is true and which talks to us over an admitted link is evidently
        alive: the frames we send it name it as suspected, and, as SWIM's refutation, it signs
        a fresher record, which beats the tombstone when it comes from itself
        (:func:`~meshnode.mesh.rules.resolve_announcement`). A node that left, or that an admin
        removed, is never named: a revocation is not refuted, and its records are refused anyway.
        """
        tombstone = self.table.tombstone(peer_id)
        return tombstone is not None and tombstone.refutable and self.revocations.node(peer_id) is None

    # -- liveness timer ------------------------------------------------------------

    def start_heartbeat(self, now_ns: int) -> None:
        """Begin heartbeating: the first is due one interval after ``now_ns``."""
        self._next_heartbeat_ns = now_ns + self.heartbeat_interval_ns

    def handle_timer(self, now_ns: int) -> None:
        """At or past the heartbeat: beat, expire tombstones, report quiet peers; earlier, nothing.

        The next heartbeat is one interval after ``now_ns``, so a late call beats once, not
        once for every interval it missed.
        """
        if self._next_heartbeat_ns is None or now_ns < self._next_heartbeat_ns:
            return
        self._next_heartbeat_ns = now_ns + self.heartbeat_interval_ns
        if self.record_heartbeats:
            self.heartbeat()
        else:
            self._heartbeat_if_changed()
        self.table.expire_tombstones(now_ns)
        self._events.append(HeartbeatDue())
        if self.record_heartbeats:
            stale = self.table.stale(now_ns=now_ns, timeout_ns=self.peer_timeout_ns)
            self._events.extend(PeerStale(peer_id) for peer_id in stale)

    def _heartbeat_if_changed(self) -> None:
        """A fresher sequence when what we announce changed since the current one was first
        published (signed, or summarized in a digest): two records of ours never share a version,
        so a peer holding our record at some version holds its content, whoever relayed it."""
        content = mesh.PeerAnnouncement()
        content.CopyFrom(self.local)
        content.heartbeat_seq = 0
        serialized = content.SerializeToString(deterministic=True)
        if self._versioned_content is not None and serialized != self._versioned_content:
            self.heartbeat()
        self._versioned_content = serialized

    def get_timer(self) -> int | None:
        """When the next heartbeat is due (monotonic ns); None before :meth:`start_heartbeat`."""
        return self._next_heartbeat_ns

    def take_events(self) -> list[MeshEvent]:
        """What the timer produced since the last call, in order."""
        events, self._events = self._events, []
        return events

    # -- frames we send ----------------------------------------------------------

    def our_proof(self, verifier_id: bytes) -> membership.MembershipProof:
        if self.membership is not None:
            return certificate_proof(self.membership.certificate)
        assert self.invite is not None
        return make_invite_proof(self.invite, joiner_id=self.node_id, verifier_id=verifier_id)

    def local_version(self) -> tuple[int, int]:
        """Our record's (incarnation, sequence) as a digest publishes it now: under
        ``record_heartbeats=False`` one fresher first if the content changed since it was published."""
        if not self.record_heartbeats:
            self._heartbeat_if_changed()
        return (self.local.incarnation, self.local.heartbeat_seq)

    def local_record(self) -> mesh.SignedPeerRecord:
        """Our announcement as we sign it now (signed again only when it changed)."""
        if not self.record_heartbeats:
            self._heartbeat_if_changed()
        return self._local_record.signed(self.local)

    def gossip_frame(self, verifier_id: bytes) -> mesh.GossipFrame:
        frame = mesh.GossipFrame(gen=NODE_PROTOCOL_GENERATION, sender_id=self.node_id)
        frame.entries.add().record.CopyFrom(self.local_record())
        for entry in self._table_page(self.frame_table_limit):
            frame.entries.add().record.CopyFrom(entry.record)
        frame.membership_proof.CopyFrom(self.our_proof(verifier_id))
        if self.frame_revocations:
            frame.revocations.extend(self.revocations.signed())
        else:
            naming = self.revocations.node(verifier_id)
            if naming is not None:
                frame.revocations.append(naming.signed)
        return frame

    def _table_page(self, limit: int) -> list[PeerEntry]:
        """The whole table when it fits a frame; past that, ``limit`` entries from where the last
        page ended, so that successive frames carry all of it. A frame listing more than
        ``MAX_PEERS_PER_FRAME`` is refused as malformed: a whole table of 256 peers or more once
        made every frame of every member refused."""
        entries = self.table.entries()
        if len(entries) <= limit:
            return entries
        start = self._page_start % len(entries)
        self._page_start = start + limit
        return (entries[start:] + entries[:start])[:limit]

    def refusal_frame(self, refusal: MeshRefusal) -> mesh.GossipFrame:
        """A refusal, with our revocations: a removed node is shown the signed reason, which it can
        verify, instead of a bare code any member could send."""
        frame = mesh.GossipFrame(gen=NODE_PROTOCOL_GENERATION, sender_id=self.node_id)
        frame.refusal.CopyFrom(refusal.to_pb())
        frame.revocations.extend(self.revocations.signed())
        return frame

    def route_table(self) -> mesh.RouteTable:
        table = mesh.RouteTable(gen=NODE_PROTOCOL_GENERATION, mesh_id=self.mesh_id)
        for announcement in [self.local, *(e.announcement for e in self.table.entries())]:
            entry = table.entries.add(
                endpoint_id=announcement.endpoint_id, model=announcement.serving.model_name
            )
            if announcement.HasField("serving"):
                entry.serving.CopyFrom(announcement.serving)
        return table

    # -- frames we receive -------------------------------------------------------

    def receive_gossip(
        self, frame: mesh.GossipFrame, *, peer_id: bytes, now_ns: int, unix_now: float
    ) -> GossipOutcome:
        validate_gossip_frame(frame, peer_id)
        if frame.HasField("refusal") or frame.HasField("membership_grant"):
            raise MeshRefusal(mesh.MESH_ERROR_PROTOCOL, "an opening GossipFrame carries a reply-only field")
        # Membership first: a stranger does not get one signature check per record (or revocation)
        # it sends. Then its revocations, which may name the sender itself (it carries its own).
        admission = self._check_credentials(frame, peer_id, unix_now)
        self._learn_from(frame, now_ns)
        self.gate.check_not_revoked(peer_id)
        verified = admission.verified
        opened = self._open_records(frame, peer_id, unix_now)
        grant: membership.MembershipGrant | None = None
        if verified is not None and verified.via_invite:
            if self.membership is None:
                raise MeshRefusal(
                    mesh.MESH_ERROR_NOT_ADMITTED, "this node is still joining; ask another member"
                )
            if not self.membership.is_admin:
                raise MeshRefusal(
                    mesh.MESH_ERROR_NOT_ADMITTED,
                    "only an admin admits by invite; this node is a plain member",
                )
        self._check_room_for(peer_id)
        grant = self.gate.grant_for(peer_id, admission, self.membership, unix_now=unix_now)
        self._admitted.add(peer_id)
        merged = self._merge(opened, now_ns)
        reply = self.gossip_frame(peer_id)
        if grant is not None:
            reply.membership_grant.CopyFrom(grant)
        return GossipOutcome(
            reply=reply,
            newly_admitted=verified is not None,
            via_invite=verified is not None and verified.via_invite,
            merged=merged,
            invite_id=verified.invite_public_key if verified is not None else b"",
        )

    def receive_gossip_reply(
        self, frame: mesh.GossipFrame, *, peer_id: bytes, now_ns: int, unix_now: float
    ) -> ReplyOutcome:
        if frame.HasField("refusal"):
            # Checked, not believed: only a verified revocation naming us makes us leave.
            self._learn_from(frame, now_ns)
            raise RemoteRefusal(frame.refusal.code, frame.refusal.detail)
        validate_gossip_frame(frame, peer_id)
        self._learn_from(frame, now_ns)
        verified = self._check_credentials(frame, peer_id, unix_now).verified
        if verified is not None and verified.via_invite:
            raise MeshRefusal(
                mesh.MESH_ERROR_PROTOCOL, "a member answers with its certificate, not an invite"
            )
        opened = self._open_records(frame, peer_id, unix_now)
        joined = renewed = False
        if frame.HasField("membership_grant"):
            mesh_key, certificate = open_grant(
                frame.membership_grant, mesh_id=self.mesh_id, node_id=self.node_id, unix_now=unix_now
            )
            if self.membership is None:
                # Kept: the relays this node registers with (its invite's, merged with --relay).
                relays = [Endpoint(id=bytes(r.relay_id), address=r.address) for r in self.local.relays]
                self.membership = MembershipState(mesh_key=mesh_key, certificate=certificate, relays=relays)
                joined = True
            else:
                renewed = self._take_renewal(mesh_key, certificate)
        elif self.membership is None:
            raise MeshRefusal(mesh.MESH_ERROR_PROTOCOL, "admitted without a membership grant")
        self._admitted.add(peer_id)
        merged = self._merge(opened, now_ns)
        return ReplyOutcome(
            newly_admitted=verified is not None, joined=joined, merged=merged, renewed=renewed
        )

    def _check_room_for(self, peer_id: bytes) -> None:
        """A peer new to us is refused, not half-admitted, when the table holds its most: its
        record would be ignored, so nobody here would route to it or gossip with it."""
        table = self.table
        if peer_id in table or self.is_admitted(peer_id) or len(table) < table.max_peers:
            return
        raise MeshRefusal(
            mesh.MESH_ERROR_TABLE_FULL,
            f"this node's peer table holds its most, {table.max_peers} members (--max-peers)",
        )

    def _take_renewal(self, mesh_key: MeshKey | None, certificate: membership.MemberCertificate) -> bool:
        """A renewed certificate replaces ours only if it lasts longer; the mesh key makes us an admin."""
        ours = self.membership
        assert ours is not None
        took = False
        new_body = membership.MemberCertificateBody.FromString(certificate.body)
        held = ours.certificate_body
        if new_body.expires_unix > held.expires_unix or (new_body.admin and not held.admin):
            ours.certificate = certificate
            took = True
        if mesh_key is not None and ours.mesh_key is None:
            ours.mesh_key = mesh_key
            took = True
        return took

    def _learn_from(self, frame: mesh.GossipFrame, now_ns: int) -> None:
        if frame.revocations:
            self.learn_revocations(list(frame.revocations), now_ns=now_ns)

    def _check_credentials(self, frame: mesh.GossipFrame, peer_id: bytes, unix_now: float) -> Admission:
        try:
            return self.gate.check(
                frame, peer_id=peer_id, admitted=peer_id in self._admitted, unix_now=unix_now
            )
        except MeshRefusal:
            self._admitted.discard(peer_id)  # refused now: no stream of it is served until it proves again
            raise

    def merge_relayed(
        self, entries: Iterable[mesh.GossipEntry], *, peer_id: bytes, now_ns: int, unix_now: float
    ) -> MergeReport:
        """Merge records an admitted peer relayed outside a GossipFrame (delta gossip,
        :mod:`meshnode.mesh.digest_gossip`): each is verified against the node it names and a
        revoked node's is dropped, as in a frame; the sender's own record need not be among them."""
        return self._merge(self._open_relayed(entries, peer_id, unix_now), now_ns)

    def _open_records(self, frame: mesh.GossipFrame, peer_id: bytes, unix_now: float) -> OpenedGossip:
        """The frame's sound records; refuses the frame when the sender's own is not one."""
        opened = open_gossip_entries(
            frame.entries, sender=peer_id, mesh_id=self.mesh_id, unix_now=unix_now, held=self.table.record_of
        )
        self.record_drops.update(drop.fault.value for drop in opened.dropped)
        opened.sender_record()
        return self._without_revoked(opened)

    def _open_relayed(
        self, entries: Iterable[mesh.GossipEntry], peer_id: bytes, unix_now: float
    ) -> OpenedGossip:
        opened = open_gossip_entries(
            entries, sender=peer_id, mesh_id=self.mesh_id, unix_now=unix_now, held=self.table.record_of
        )
        self.record_drops.update(drop.fault.value for drop in opened.dropped)
        return self._without_revoked(opened)

    def _without_revoked(self, opened: OpenedGossip) -> OpenedGossip:
        # A removed node's record is not merged from anyone: others may not have heard of its removal yet.
        kept = [r for r in opened.records if self.revocations.node(r.node_id) is None]
        if len(kept) != len(opened.records):
            self.record_drops["revoked"] += len(opened.records) - len(kept)
            opened = OpenedGossip(sender=opened.sender, records=kept, dropped=opened.dropped)
        return opened

    def _merge(self, opened: OpenedGossip, now_ns: int) -> MergeReport:
        report = self.table.merge(opened.records, from_peer=opened.sender, now_ns=now_ns)
        report.dropped = opened.dropped
        return report


__all__ = ["GossipOutcome", "HeartbeatDue", "MeshEvent", "MeshState", "PeerStale", "ReplyOutcome"]
