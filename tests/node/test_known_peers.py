"""The peers a member stores keep those that left, so a mesh stopped node by node finds itself again."""

from __future__ import annotations

import socket
import time

import pytest
from helpers.mesh_nodes import fast_config, start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.membership.revocation import RevocationList, revoke_node
from meshnode.membership.store import MAX_KNOWN_PEERS, DataDir
from meshnode.mesh.known_peers import peers_to_remember
from meshnode.mesh.peer_table import PeerTable
from meshnode.mesh.signed_record import VerifiedRecord, sign_record
from meshnode.node import Node
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(90)


IDENTITIES = [NodeIdentity.from_seed(bytes([n]) * 32) for n in range(1, 8)]
ME, P1, P2, P3, P4, P5, P6 = (identity.node_id for identity in IDENTITIES)


def record(identity: NodeIdentity, *addresses: str) -> VerifiedRecord:
    announcement = mesh.PeerAnnouncement(
        endpoint_id=identity.node_id, incarnation=1, addresses=list(addresses)
    )
    signed = sign_record(identity, announcement)
    return VerifiedRecord(mesh.PeerAnnouncement.FromString(signed.record), signed)


def table_of(*records: VerifiedRecord) -> PeerTable:
    table = PeerTable(ME, tombstone_ttl_ns=60 * SECOND_NS)
    table.merge(records, from_peer=records[0].announcement.endpoint_id, now_ns=0)
    return table


def remember(table: PeerTable, stored: list[Endpoint], *, revocations=None, limit=MAX_KNOWN_PEERS):
    kept = peers_to_remember(table, stored, revocations=revocations or RevocationList("mesh"), limit=limit)
    return [(e.id, e.address) for e in kept]


def test_the_tables_peers_come_first_then_those_it_removed_latest_first_then_the_stored() -> None:
    p1, p2, p3, p4 = IDENTITIES[1:5]
    table = table_of(
        record(p1, "10.0.0.1:7447", "[fd00::1]:7447"),
        record(p2, "10.0.0.2:7000"),
        record(p3, "10.0.0.3:7447"),
        record(p4, "10.0.0.4:7447"),
        record(IDENTITIES[6]),  # announces no address: nothing to dial
    )
    table.remove(P4, reason="left", now_ns=1)
    table.remove(P3, reason="down", now_ns=2)
    stored = [Endpoint(P2, "10.0.0.2:7447"), Endpoint(P5, "10.0.0.5:7447"), Endpoint(P3, "10.0.9.3:1")]
    assert remember(table, stored) == [
        (P1, "10.0.0.1:7447"),
        (P2, "10.0.0.2:7000"),  # where it listens now, not where it was stored
        (P3, "10.0.0.3:7447"),
        (P4, "10.0.0.4:7447"),
        (P5, "10.0.0.5:7447"),  # left before this run: kept as stored
    ]


def test_the_node_itself_and_repeats_are_left_out_and_the_freshest_are_kept_up_to_the_limit() -> None:
    table = table_of(record(IDENTITIES[1], "10.0.0.1:1"))
    stored = [Endpoint(node, f"10.0.0.{n}:1") for n, node in ((0, ME), (5, P5), (6, P6), (5, P5), (3, P3))]
    assert remember(table, stored, limit=3) == [(P1, "10.0.0.1:1"), (P5, "10.0.0.5:1"), (P6, "10.0.0.6:1")]


def test_a_departed_peer_outlives_its_tombstone_until_it_is_listed_again_and_the_oldest_go_first() -> None:
    p1, p2, p3 = IDENTITIES[1:4]
    table = PeerTable(ME, tombstone_ttl_ns=SECOND_NS, max_departed=2)
    table.merge(
        [record(p1, "10.0.0.1:1"), record(p2, "10.0.0.2:1"), record(p3, "10.0.0.3:1")], from_peer=P1, now_ns=0
    )
    for n, peer in enumerate((P1, P2, P3)):
        table.remove(peer, reason="left", now_ns=n)
    table.merge([], from_peer=P1, now_ns=60 * SECOND_NS)  # every tombstone expired
    assert table.tombstone_count == 0
    assert table.departed() == [(P3, "10.0.0.3:1"), (P2, "10.0.0.2:1")]
    table.merge([record(p2, "10.0.0.2:2")], from_peer=P2, now_ns=61 * SECOND_NS)
    assert table.departed() == [(P3, "10.0.0.3:1")]
    assert remember(table, []) == [(P2, "10.0.0.2:2"), (P3, "10.0.0.3:1")]


def test_a_removed_member_is_not_remembered() -> None:
    mesh_key = MeshKey.generate()
    revocations = RevocationList(mesh_key.mesh_id)
    revocations.learn([revoke_node(mesh_key, node_id=P2, reason="gone", issuer_id=ME, unix_now=time.time())])
    assert revocations.node(P2) is not None
    table = table_of(record(IDENTITIES[2], "10.0.0.2:1"))
    stored = [Endpoint(P2, "10.0.0.2:1"), Endpoint(P3, "10.0.0.3:1")]
    assert remember(table, stored, revocations=revocations) == [(P3, "10.0.0.3:1")]


async def test_a_first_node_stopped_last_and_restarted_elsewhere_finds_the_member_that_stopped_before_it(
    tmp_path,
) -> None:
    """The joiner stops first (the first node drops it from its table as left), then the first node;
    the joiner restarts where it was, the first node on another port. The joiner only knows the
    first node's old address, so the mesh comes together only if the first node remembered it."""
    first = await start_first_node(tmp_path)
    joiner = await start_joiner(tmp_path, "joiner", first)
    identities = {"first": first.identity, "joiner": joiner.identity}
    joiner_address = joiner.addresses[0]
    restarted: list[Node] = []
    try:
        await eventually(lambda: joiner.node_id in first.state.table, 20, "the first node to list the joiner")
        await joiner.shutdown()
        await eventually(
            lambda: joiner.node_id not in first.state.table, 20, "the joiner to be dropped as left"
        )
    finally:
        await first.shutdown()

    def restart(name: str, listen: str) -> Node:
        identity = identities[name]
        data_dir = DataDir(tmp_path / name)
        node = Node(
            identity,
            data_dir,
            fast_config(listen=listen),
            membership=data_dir.load_membership(identity.node_id),
        )
        restarted.append(node)
        return node

    try:
        joiner_again = restart("joiner", joiner_address)
        await joiner_again.start()
        first_again = restart("first", "127.0.0.1:0")
        await first_again.start()
        assert await first_again.reconnect() == 1
        await eventually(
            lambda: (
                joiner_again.node_id in first_again.state.table
                and first_again.node_id in joiner_again.state.table
            ),
            20,
            "the restarted nodes to list each other",
        )
    finally:
        for node in restarted:
            await node.shutdown()


async def test_a_restarted_member_starts_once_one_stored_peer_answers_not_after_every_dial(tmp_path) -> None:
    """A stored peer that stopped for good (the store keeps those now) answers nothing: the restart
    goes on as soon as a live one has answered, and the dial to the silent one continues behind it."""
    first = await start_first_node(tmp_path)
    member = await start_joiner(tmp_path, "member", first)
    await member.shutdown()
    data_dir = DataDir(tmp_path / "member")
    stored = data_dir.load_membership(member.node_id)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # takes datagrams, answers none
        silent.bind(("127.0.0.1", 0))
        gone = Endpoint(NodeIdentity.generate().node_id, f"127.0.0.1:{silent.getsockname()[1]}")
        stored.known_peers = [gone, *stored.known_peers]
        data_dir.save_peers(stored)
        again = Node(member.identity, data_dir, fast_config(connect_timeout=30.0), membership=stored)
        try:
            await again.start()
            assert await again.reconnect() == 1
            assert first.node_id in again.state.table
            assert gone.id in again.gossip.in_round  # still being dialed, behind the start
        finally:
            await again.shutdown()
            await first.shutdown()
