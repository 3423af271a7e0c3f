"""Many members' mesh state machines in one process, gossiping in rounds, without sockets.

Each :class:`SimNode` is what a ``Node`` runs for membership: a real
:class:`~meshnode.mesh.state.MeshState` (its own node key, a certificate from the
mesh key, its signed record) and a :class:`~meshnode.mesh.digest_gossip.DigestGossip`
over it. Every frame is serialized, counted and decoded again on the other side,
as the node's edge does, so refusals, signature checks and bytes are the real
ones; what is left out is the transport (QUIC, its handshakes and headers) and
time, which advances one round at a time.

Two ways of gossiping, one per round:

* ``full_round``: today's, every member exchanges a full GossipFrame with every
  peer in its table (``Gossip.with_all``);
* ``digest_round``: each member keeps a partial view
  (:class:`~meshnode.mesh.partial_view.PartialView`) and opens a digest exchange
  with ``fanout`` peers of its active view; a pair that never exchanged makes a
  full exchange first (it admits them to each other, as the first exchange on a
  link does), whose frames carry no table under delta gossip. Now and then a member
  shuffles one active peer for a passive one.

Delta rounds are lockstep, the usual model of gossip analyses: the records an
exchange brings are merged when the round ends, so what a member learns travels
on only in the next round (at most one hop a round). A real mesh, whose exchanges
fall at different instants of an interval, can carry a record several hops in one
round; the rounds counted here are an upper bound of those.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from google.protobuf.message import Message

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.store import MembershipState
from meshnode.mesh.digest_gossip import DigestGossip
from meshnode.mesh.failure_detector import FailureDetector
from meshnode.mesh.partial_view import PartialView
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import decode, validate_digest_open, validate_digest_reply
from meshnode.sansio import SECOND_NS
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal
from meshnode.wire.pb import mesh

MODEL = "sim-model"
TOTAL_LAYERS = 32
# The unix time every credential and incarnation is checked against.
START_UNIX = 1_800_000_000.0


@dataclass
class Traffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    # CPU seconds spent in this member's protocol calls (encode, decode, verify, merge).
    cpu_s: float = 0.0
    exchanges: int = 0


@dataclass
class SimNode:
    identity: NodeIdentity
    state: MeshState
    digest: DigestGossip
    view: PartialView
    detector: FailureDetector
    traffic: Traffic = field(default_factory=Traffic)
    # Peers this member holds a gossip link with: all it gossiped with (full), its active view (digest).
    links: set[bytes] = field(default_factory=set)
    down: bool = False

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    def serves(self) -> bool:
        return self.state.local.HasField("serving")

    def change_record(self) -> None:
        """A new version of this member's record (its load changed), signed again when next sent."""
        self.state.local.load.active_sessions += 1
        self.state.local.heartbeat_seq += 1


class SimMesh:
    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        delta: bool = True,
        fanout: int = 3,
        active_size: int = 8,
        passive_size: int = 32,
        shuffle_chance: float = 0.1,
        retry_chance: float = 0.1,
        tombstone_ttl_rounds: int = 60,
        serving_every: int = 2,
    ) -> None:
        self.rng = random.Random(seed)
        self.delta = delta
        self.fanout = fanout
        self.active_size = active_size
        self.passive_size = passive_size
        self.shuffle_chance = shuffle_chance
        self.retry_chance = retry_chance
        self.tombstone_ttl_rounds = tombstone_ttl_rounds
        self.mesh_key = MeshKey.generate()
        self.mesh_id = self.mesh_key.mesh_id
        self.round = 0
        self.refusals: Counter[str] = Counter()
        # Every frame's bytes, by message type.
        self.bytes_by_kind: Counter[str] = Counter()
        # Which pairs are cut off from each other (a partition): a member of one side reaches none
        # of the other.
        self.side: dict[bytes, int] = {}
        # Records and revocations delta exchanges brought this round: (receiver, what, from whom).
        self._arrived: list[tuple[SimNode, mesh.DigestRecords, bytes]] = []
        self._serving_count = 0
        self.nodes: list[SimNode] = [self._new_node(i, serving=i % serving_every == 0) for i in range(size)]
        self.by_id = {n.node_id: n for n in self.nodes}

    def _new_node(self, index: int, *, serving: bool) -> SimNode:
        identity = NodeIdentity.from_seed(self.rng.randbytes(32))
        local = mesh.PeerAnnouncement(
            role=mesh.NODE_ROLE_WORKER,
            version="sim",
            hostname=f"sim-{index}",
            addresses=[f"10.{index // 65536}.{index // 256 % 256}.{index % 256}:7000"],
            directly_reachable=True,
            incarnation=int(START_UNIX * SECOND_NS) - index,
        )
        if serving:
            # Serving members take the model's four quarters in turn.
            start = self._serving_count % 4 * (TOTAL_LAYERS // 4)
            self._serving_count += 1
            local.serving.model_name = MODEL
            local.serving.shard_range.start_layer = start
            local.serving.shard_range.end_layer = start + TOTAL_LAYERS // 4
            local.serving.total_layers = TOTAL_LAYERS
            local.serving.fingerprint.model_artifact_digest = "sim-artifact"
            local.serving.fingerprint.runtime_recipe_digest = "sim-recipe"
            local.serving.speed.decode_us_per_token = 1000 + index % 97 * 10
            local.serving.speed.source = mesh.STAGE_SPEED_SOURCE_MEASURED
            local.capacity.max_concurrent_sessions = 4
        certificate = issue_certificate(
            self.mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=START_UNIX
        )
        state = MeshState(
            identity=identity,
            mesh_id=self.mesh_id,
            local=local,
            membership=MembershipState(mesh_key=None, certificate=certificate),
            max_peers=4096,
            tombstone_ttl_ns=self.tombstone_ttl_rounds * SECOND_NS,
            **({"frame_table_limit": 0} if self.delta else {}),
        )
        rng = random.Random(self.rng.random())
        view = PartialView(
            identity.node_id, active_size=self.active_size, passive_size=self.passive_size, rng=rng
        )
        detector = FailureDetector(identity.node_id, rng=rng)
        return SimNode(identity, state, DigestGossip(state, rng=rng), view, detector)

    # -- time ---------------------------------------------------------------------------------

    @property
    def now_ns(self) -> int:
        return (1000 + self.round) * SECOND_NS

    @property
    def unix_now(self) -> float:
        return START_UNIX + self.round

    # -- reachability -------------------------------------------------------------------------

    def reachable(self, a: SimNode, b: SimNode) -> bool:
        return not b.down and self.side.get(a.node_id, 0) == self.side.get(b.node_id, 0)

    def partition(self, half: list[SimNode]) -> None:
        for node in half:
            self.side[node.node_id] = 1

    def heal(self) -> None:
        self.side.clear()

    # -- exchanges ------------------------------------------------------------------------------

    def _send(self, sender: SimNode, receiver: SimNode, message: Message) -> bytes:
        data = message.SerializeToString()
        self.bytes_by_kind[type(message).__name__] += len(data)
        sender.traffic.bytes_sent += len(data)
        receiver.traffic.bytes_received += len(data)
        return data

    def full_exchange(self, opener: SimNode, responder: SimNode) -> bool:
        """Today's exchange: one GossipFrame each way. Whether it completed."""
        if not self.reachable(opener, responder):
            return False
        start = time.process_time()
        frame = opener.state.gossip_frame(responder.node_id)
        data = self._send(opener, responder, frame)
        opener.traffic.cpu_s += (middle := time.process_time()) - start
        try:
            outcome = responder.state.receive_gossip(
                decode(mesh.GossipFrame, data),
                peer_id=opener.node_id,
                now_ns=self.now_ns,
                unix_now=self.unix_now,
            )
            reply = outcome.reply
        except MeshRefusal as refusal:
            self.refusals[refusal.code_name] += 1
            reply = responder.state.refusal_frame(refusal)
        data = self._send(responder, opener, reply)
        responder.traffic.cpu_s += (after := time.process_time()) - middle
        try:
            opener.state.receive_gossip_reply(
                decode(mesh.GossipFrame, data),
                peer_id=responder.node_id,
                now_ns=self.now_ns,
                unix_now=self.unix_now,
            )
        except RemoteRefusal:
            return False
        except MeshRefusal as refusal:
            self.refusals[refusal.code_name] += 1
            return False
        finally:
            opener.traffic.cpu_s += time.process_time() - after
        opener.traffic.exchanges += 1
        responder.traffic.exchanges += 1
        if not self.delta:
            opener.links.add(responder.node_id)
            responder.links.add(opener.node_id)
        return True

    def digest_exchange(self, opener: SimNode, responder: SimNode, suspect: tuple[bytes, ...] = ()) -> bool:
        """A delta exchange (four frames); a pair not yet admitted to each other exchanges in full first."""
        if not self.reachable(opener, responder):
            return False
        admitted = opener.state.is_admitted(responder.node_id) and responder.state.is_admitted(opener.node_id)
        if not admitted and not self.full_exchange(opener, responder):
            return False
        try:
            t0 = time.process_time()
            sent = opener.digest.open()
            sent.suspected.extend(dict.fromkeys([*opener.detector.rumors(), *suspect]))
            data = self._send(opener, responder, sent)
            t1 = time.process_time()
            opened = decode(mesh.DigestOpen, data)
            validate_digest_open(opened, opener.node_id)
            self._hear(responder, opened.suspected, opener)
            reply = responder.digest.answer_open(opened, peer_id=opener.node_id)
            reply.suspected.extend(responder.detector.rumors())
            data = self._send(responder, opener, reply)
            t2 = time.process_time()
            answered = decode(mesh.DigestReply, data)
            validate_digest_reply(answered, responder.node_id, sent.bucket_count)
            self._hear(opener, answered.suspected, responder)
            push = opener.digest.answer_reply(sent, answered, peer_id=responder.node_id)
            data = self._send(opener, responder, push)
            t3 = time.process_time()
            pushed = decode(mesh.DigestPush, data)
            # The responder answers from what it held when the round began; it merges at its end.
            records, _ = responder.digest.answer_push(
                self._without_records(pushed),
                peer_id=opener.node_id,
                now_ns=self.now_ns,
                unix_now=self.unix_now,
            )
            arrived = mesh.DigestRecords(
                gen=pushed.gen,
                sender_id=pushed.sender_id,
                entries=pushed.entries,
                revocations=pushed.revocations,
            )
            self._arrived.append((responder, arrived, opener.node_id))
            data = self._send(responder, opener, records)
            t4 = time.process_time()
            self._arrived.append((opener, decode(mesh.DigestRecords, data), responder.node_id))
            t5 = time.process_time()
        except MeshRefusal as refusal:
            self.refusals[refusal.code_name] += 1
            return False
        opener.traffic.cpu_s += (t1 - t0) + (t3 - t2) + (t5 - t4)
        responder.traffic.cpu_s += (t2 - t1) + (t4 - t3)
        opener.traffic.exchanges += 1
        responder.traffic.exchanges += 1
        opener.detector.alive(responder.node_id)
        responder.detector.alive(opener.node_id)
        self._link(opener, responder)
        return True

    @staticmethod
    def _hear(node: SimNode, suspected: list[bytes], sender: SimNode) -> None:
        """Suspicions a peer passed on: checked by our own probes later; one naming us is refuted
        at once by a fresher record (SWIM's refutation; ours is signed by us, as every record)."""
        if node.node_id in suspected:
            node.state.heartbeat()
        node.detector.heard(suspected, sender=sender.node_id)

    # -- failure detection -------------------------------------------------------------------

    def _probe(self, node: SimNode, target: SimNode) -> None:
        """A probe of ``target`` and, when it fails, ``indirect_probes`` helpers' probes of it."""
        probe = len(mesh.Probe(gen=1, nonce=b"n" * 16).SerializeToString())
        node.traffic.bytes_sent += probe
        if self.reachable(node, target):
            node.traffic.bytes_received += probe
            node.detector.alive(target.node_id)
            return
        members = node.state.table.peer_ids()
        for helper_id in node.detector.helpers_for(target.node_id, members):
            helper = self.by_id[helper_id]
            if not self.reachable(node, helper):
                continue
            # Our request and its answer; the helper's probe of the target (and its answer).
            node.traffic.bytes_sent += probe + 32
            node.traffic.bytes_received += probe
            helper.traffic.bytes_received += probe + 32
            helper.traffic.bytes_sent += 2 * probe
            if self.reachable(helper, target):
                helper.traffic.bytes_received += probe
                node.detector.alive(target.node_id)
                return
        node.detector.unreachable(target.node_id)

    def _detect(self, node: SimNode) -> None:
        """This round's failure detection for ``node``: remove the confirmed, probe one member and
        the suspects others named, and now and then try a peer removed earlier (a healed partition)."""
        known = set(node.state.table.peer_ids())
        plan = node.detector.start_round(known)
        for peer_id in plan.confirmed:
            node.state.remove_peer(peer_id, reason="confirmed down", now_ns=self.now_ns)
            node.view.drop(peer_id, failed=True)
            node.links.discard(peer_id)
        for peer_id in (plan.probe, *plan.checks):
            if peer_id is not None:
                self._probe(node, self.by_id[peer_id])
        departed = node.state.table.departed()
        if departed and self.rng.random() < self.retry_chance:
            peer = self.by_id[self.rng.choice(departed)[0]]
            if peer.node_id not in node.state.table and self.reachable(node, peer):
                # It is alive after all: tell it what we believed, so it refutes with a fresher record.
                self.digest_exchange(node, peer, suspect=(peer.node_id,))

    @staticmethod
    def _without_records(push: mesh.DigestPush) -> mesh.DigestPush:
        return mesh.DigestPush(
            gen=push.gen,
            sender_id=push.sender_id,
            wanted=push.wanted,
            wanted_revocations=push.wanted_revocations,
        )

    def _merge_arrived(self) -> None:
        arrived, self._arrived = self._arrived, []
        for node, frame, sender in arrived:
            start = time.process_time()
            try:
                node.digest.take_records(frame, peer_id=sender, now_ns=self.now_ns, unix_now=self.unix_now)
            except MeshRefusal as refusal:
                self.refusals[refusal.code_name] += 1
            node.traffic.cpu_s += time.process_time() - start

    def _link(self, opener: SimNode, responder: SimNode) -> None:
        """The views after an exchange: each side keeps the other active; whoever that evicts
        loses its link to the evicter."""
        for node, peer in ((opener, responder), (responder, opener)):
            evicted = node.view.accept(peer.node_id)
            node.links.add(peer.node_id)
            if evicted is not None:
                self._unlink(node, self.by_id[evicted])

    def _unlink(self, node: SimNode, peer: SimNode) -> None:
        node.links.discard(peer.node_id)
        peer.links.discard(node.node_id)
        node.view.drop(peer.node_id, failed=False)
        peer.view.drop(node.node_id, failed=False)

    # -- rounds --------------------------------------------------------------------------------

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes if not n.down]

    def _members_in_random_order(self) -> list[SimNode]:
        members = self.live()
        self.rng.shuffle(members)
        return members

    def full_round(self) -> None:
        """Today's heartbeat: each member bumps its sequence and exchanges with every peer it knows."""
        self.round += 1
        for node in self.live():
            node.state.heartbeat()
        for node in self._members_in_random_order():
            for peer_id in node.state.table.peer_ids():
                peer = self.by_id.get(peer_id)
                if peer is not None:
                    self.full_exchange(node, peer)

    def digest_round(self) -> None:
        """Each member refreshes its view from its table, shuffles now and then, and opens a digest
        exchange with ``fanout`` peers of its active view; an unreachable one leaves the view."""
        self.round += 1
        # Pairs that exchanged this round: neither opens another exchange to the other in it.
        synced: dict[bytes, set[bytes]] = {}
        for node in self._members_in_random_order():
            self._detect(node)
            node.view.refresh(set(node.state.table.peer_ids()))
            if self.rng.random() < self.shuffle_chance:
                swapped = node.view.shuffle()
                if swapped is not None:
                    left = self.by_id[swapped[0]]
                    node.links.discard(left.node_id)
                    left.links.discard(node.node_id)
                    left.view.drop(node.node_id, failed=False)
            for peer_id in node.view.targets(self.fanout, synced.get(node.node_id, set())):
                peer = self.by_id[peer_id]
                if self.digest_exchange(node, peer):
                    synced.setdefault(node.node_id, set()).add(peer_id)
                    synced.setdefault(peer_id, set()).add(node.node_id)
                else:
                    node.view.drop(peer_id, failed=True)
                    node.links.discard(peer_id)
                    if not self.reachable(node, peer):
                        self._probe(node, peer)  # a failed exchange is a failed probe: ask helpers
        self._merge_arrived()

    def gossip_round(self) -> None:
        """A round of this mesh's gossip: delta or today's full one."""
        if self.delta:
            self.digest_round()
        else:
            self.full_round()

    def kill(self, node: SimNode) -> None:
        """Like a SIGKILL: it answers nothing more, and its links are gone."""
        node.down = True
        for peer_id in list(node.links):
            self.by_id[peer_id].links.discard(node.node_id)
        node.links.clear()

    # -- joining ---------------------------------------------------------------------------------

    def add_member(self, bootstrap: SimNode) -> SimNode:
        """A new member, whose first exchange is with ``bootstrap`` (its invite's bootstrap peer)."""
        node = self._new_node(len(self.nodes), serving=True)
        self.nodes.append(node)
        self.by_id[node.node_id] = node
        if self.delta:
            self.digest_exchange(node, bootstrap)
            self._merge_arrived()
        else:
            self.full_exchange(node, bootstrap)
        return node

    def join_all_through(self, seed: SimNode) -> None:
        """Each other member makes its first exchange with ``seed`` (its invite's bootstrap peer)."""
        for node in self.nodes:
            if node is not seed:
                if self.delta:
                    self.digest_exchange(node, seed)
                    self._merge_arrived()
                else:
                    self.full_exchange(node, seed)

    # -- what members know ----------------------------------------------------------------------

    def knowing_down(self, node: SimNode) -> int:
        """How many live members no longer list ``node``."""
        return sum(node.node_id not in other.state.table for other in self.live() if other is not node)

    def holders_of(self, node: SimNode) -> int:
        """How many other live members hold ``node``'s current record."""
        version = (node.state.local.incarnation, node.state.local.heartbeat_seq)
        count = 0
        for other in self.live():
            if other is node:
                continue
            held = other.state.table.announcement_of(node.node_id)
            if held is not None and (held.incarnation, held.heartbeat_seq) >= version:
                count += 1
        return count

    def missing_serving_records(self) -> int:
        """(member, serving member) pairs where the first lacks the second's current record."""
        servers = [n for n in self.live() if n.serves()]
        return sum(len(servers) - (n in servers) - self._holds_current(n, servers) for n in self.live())

    def _holds_current(self, node: SimNode, others: list[SimNode]) -> int:
        count = 0
        for other in others:
            if other is node:
                continue
            held = node.state.table.announcement_of(other.node_id)
            if held is not None and held.heartbeat_seq >= other.state.local.heartbeat_seq:
                count += 1
        return count

    def converged(self) -> bool:
        """Every live member holds every other live member's current record."""
        size = len(self.live())
        return all(self.holders_of(n) == size - 1 for n in self.live())


__all__ = ["MODEL", "SimMesh", "SimNode", "Traffic"]
