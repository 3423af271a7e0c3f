"""In-process nodes over real QUIC on loopback: joining, admission refusals, liveness.

Each negative case asserts the exact refusal code the node sends back, and that
the node keeps serving afterwards.
"""

import asyncio
import time

import pytest
from helpers.mesh_helpers import RawPeer, entry_ids, exchange, reset_code_of
from helpers.mesh_nodes import fast_config, start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    certificate_proof,
    create_invite,
    issue_certificate,
    make_invite_proof,
)
from meshnode.membership.store import DataDir
from meshnode.node import JoinError, Node
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def first(tmp_path):
    node = await start_first_node(tmp_path)
    yield node
    await node.shutdown()


def certificate_for(node: Node, peer: RawPeer) -> membership.MembershipProof:
    mesh_key = node.state.membership.mesh_key
    return certificate_proof(
        issue_certificate(mesh_key, node_id=peer.node_id, issuer_id=node.node_id, unix_now=time.time())
    )


def invite_for(node: Node, *, mesh_key=None, ttl=3600.0, now=None):
    return create_invite(
        mesh_key or node.state.membership.mesh_key,
        issuer_id=node.node_id,
        bootstrap=[Endpoint(node.node_id, node.addresses[0])],
        ttl_s=ttl,
        unix_now=now if now is not None else time.time(),
    )


def gossip_from(peer: RawPeer, node: Node, proof=None, **fields) -> bytes:
    frame = mesh.GossipFrame(gen=1, sender_id=peer.node_id, entries=[peer.entry(node.mesh_id)])
    if proof is not None:
        frame.membership_proof.CopyFrom(proof)
    for name, value in fields.items():
        setattr(frame, name, value)
    return frame.SerializeToString()


async def gossip_refusal(link, body: bytes) -> int:
    reply = mesh.GossipFrame.FromString(await exchange(link, StreamType.GOSSIP, body))
    assert reply.HasField("refusal"), "expected a refusal"
    assert not reply.entries and not reply.HasField("membership_grant")
    return reply.refusal.code


async def route_table(link) -> mesh.RouteTable:
    body = mesh.RouteTableRequest(gen=1).SerializeToString()
    return mesh.RouteTable.FromString(await exchange(link, StreamType.ROUTE_REQUEST, body))


# -- joining --------------------------------------------------------------------------------------------


async def test_a_heartbeats_gossip_on_a_link_already_exchanged_does_not_hold_up_get_link(tmp_path, first):
    joiner = await start_joiner(tmp_path, "joiner", first)
    try:
        link = await joiner.get_link(first.node_id)
        # A heartbeat's exchange is under way on the link...
        heartbeat = asyncio.ensure_future(joiner.gossip.exchange(link))
        await asyncio.sleep(0)
        # ...and a caller wanting the link gets it now, not after an exchange of its own.
        assert await joiner.get_link(first.node_id) is link
        assert not heartbeat.done()
        await heartbeat
    finally:
        await joiner.shutdown()


async def test_invite_join_makes_a_stored_member_and_both_list_each_other(tmp_path, first):
    joiner = await start_joiner(tmp_path, "joiner", first)
    try:
        await eventually(lambda: joiner.node_id in first.state.table and first.node_id in joiner.state.table)
        assert joiner.state.is_member and joiner.mesh_id == first.mesh_id
        stored = DataDir(tmp_path / "joiner").load_membership(joiner.node_id)
        assert stored.mesh_id == first.mesh_id
        assert first.node_id in {e.id for e in stored.known_peers}
        (peer,) = first.status().peers
        assert peer.short_id == joiner.identity.short_id
        assert peer.link is not None and peer.link.startswith("quic ") and peer.admitted
    finally:
        await joiner.shutdown()


async def test_a_third_node_is_learned_through_gossip_and_linked(tmp_path, first):
    second = await start_joiner(tmp_path, "second", first)
    third = await start_joiner(tmp_path, "third", first)
    nodes = [first, second, third]
    try:

        def everyone_sees_everyone():
            return all(
                {n.node_id for n in nodes} - {node.node_id} <= set(node.state.table.peer_ids())
                for node in nodes
            )

        await eventually(everyone_sees_everyone)
        await eventually(
            lambda: second.link_to(third.node_id) is not None and third.link_to(second.node_id) is not None
        )
    finally:
        for node in (third, second):
            await node.shutdown()


async def test_simultaneous_dials_leave_one_agreed_link(tmp_path, first):
    other = await start_first_node(tmp_path, "other", mesh_key=first.state.membership.mesh_key)
    try:
        # Both dial at once: two QUIC connections exist for one peer pair.
        dialed = await asyncio.gather(
            first.endpoint.dial(other.addresses[0], other.node_id),
            other.endpoint.dial(first.addresses[0], first.node_id),
        )
        assert dialed[0] is not dialed[1]

        def one_link_each():
            return first.link_to(other.node_id) is not None and other.link_to(first.node_id) is not None

        await eventually(one_link_each)
        await eventually(lambda: sum(not link.is_closed for link in dialed) == 1)
        kept_a, kept_b = first.link_to(other.node_id), other.link_to(first.node_id)
        assert kept_a is not None and kept_b is not None
        # Both ends kept the same connection: the one dialed by the lower node id.
        lower = min(first.node_id, other.node_id)
        assert (first.node_id if kept_a.initiated_locally else other.node_id) == lower
        assert (other.node_id if kept_b.initiated_locally else first.node_id) == lower
        assert await first.probe(other.node_id) and await other.probe(first.node_id)
    finally:
        await other.shutdown()


async def test_get_link_from_both_sides_at_once_succeeds_on_the_surviving_link(tmp_path, first):
    other = await start_first_node(tmp_path, "other", mesh_key=first.state.membership.mesh_key)
    try:
        first.add_known_peer(Endpoint(other.node_id, other.addresses[0]))
        other.add_known_peer(Endpoint(first.node_id, first.addresses[0]))
        link_a, link_b = await asyncio.gather(first.get_link(other.node_id), other.get_link(first.node_id))
        await eventually(lambda: not link_a.is_closed and not link_b.is_closed)
        assert first.state.is_admitted(other.node_id) and other.state.is_admitted(first.node_id)
    finally:
        await other.shutdown()


async def test_a_gossip_exchange_cut_off_by_a_timeout_leaves_the_link_usable(tmp_path, first):
    # A heartbeat or probe that times out cancels the gossip exchange it was waiting on. The
    # next get_link on that link raised CancelledError (a cancelled future's exception()),
    # so probes raised instead of answering and callers saw themselves cancelled.
    other = await start_first_node(tmp_path, "other", mesh_key=first.state.membership.mesh_key)
    try:
        first.add_known_peer(Endpoint(other.node_id, other.addresses[0]))
        link = await first.get_link(other.node_id)
        cut_off = asyncio.ensure_future(first.gossip.exchange(link))  # as a heartbeat starts one
        await asyncio.sleep(0)
        cut_off.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut_off
        assert await first.probe(other.node_id)
        assert await first.get_link(other.node_id) is link
    finally:
        await other.shutdown()


async def test_join_refusal_is_a_one_line_reason(tmp_path, first):
    expired = invite_for(first, ttl=10, now=time.time() - 60)
    node = Node(NodeIdentity.generate(), DataDir(tmp_path / "late"), fast_config(), invite=expired)
    await node.start()
    try:
        with pytest.raises(JoinError, match="invite expired") as info:
            await node.join()
        assert "\n" not in str(info.value)
        assert not node.state.is_member and not DataDir(tmp_path / "late").has_membership()
    finally:
        await node.shutdown()


# -- negative cases: each refusal with its exact code ------------------------------------------------------------


async def test_gossip_without_an_invite_is_refused_and_the_connection_kept(first):
    async with RawPeer() as peer:
        link = await peer.connect(first)
        assert await gossip_refusal(link, gossip_from(peer, first)) == mesh.MESH_ERROR_NO_CREDENTIAL
        assert peer.node_id not in first.state.table and not first.state.is_admitted(peer.node_id)
        # Route tables are answered without admitting, on the same connection.
        table = await route_table(link)
        assert table.mesh_id == first.mesh_id and [e.endpoint_id for e in table.entries] == [first.node_id]
        assert not first.state.is_admitted(peer.node_id) and peer.node_id not in first.state.table
        assert first.status().refusals.gossip == {"MESH_ERROR_NO_CREDENTIAL": 1}


async def test_expired_foreign_and_tampered_invites_are_refused(first):
    async with RawPeer() as peer:
        link = await peer.connect(first)

        def proof(invite):
            return make_invite_proof(invite, joiner_id=peer.node_id, verifier_id=first.node_id)

        expired = invite_for(first, ttl=10, now=time.time() - 60)
        assert (
            await gossip_refusal(link, gossip_from(peer, first, proof(expired)))
            == mesh.MESH_ERROR_INVITE_EXPIRED
        )

        foreign = invite_for(first, mesh_key=MeshKey.generate())
        assert (
            await gossip_refusal(link, gossip_from(peer, first, proof(foreign))) == mesh.MESH_ERROR_OTHER_MESH
        )

        tampered = proof(invite_for(first))
        body = membership.InviteBody.FromString(tampered.invite.body)
        body.expires_unix += 10**6
        tampered.invite.body = body.SerializeToString()
        assert await gossip_refusal(link, gossip_from(peer, first, tampered)) == mesh.MESH_ERROR_FORGED

        # A proof captured from another joiner is useless to this identity.
        stolen = make_invite_proof(invite_for(first), joiner_id=b"\x07" * 32, verifier_id=first.node_id)
        assert await gossip_refusal(link, gossip_from(peer, first, stolen)) == mesh.MESH_ERROR_FORGED

        assert peer.node_id not in first.state.table
        # Finally a valid invite is accepted on the very same connection.
        reply = mesh.GossipFrame.FromString(
            await exchange(link, StreamType.GOSSIP, gossip_from(peer, first, proof(invite_for(first))))
        )
        assert reply.HasField("membership_grant") and first.state.is_admitted(peer.node_id)


async def test_gossip_sender_mismatch_and_bad_generation_are_refused(first):
    async with RawPeer() as peer:
        link = await peer.connect(first)
        proof = certificate_for(first, peer)
        someone = NodeIdentity.generate().node_id
        forged_sender = mesh.GossipFrame(gen=1, sender_id=someone, entries=[peer.entry(first.mesh_id)])
        forged_sender.membership_proof.CopyFrom(proof)
        code = await gossip_refusal(link, forged_sender.SerializeToString())
        assert code == mesh.MESH_ERROR_SENDER_MISMATCH
        code = await gossip_refusal(link, gossip_from(peer, first, proof, gen=2))
        assert code == mesh.MESH_ERROR_BAD_GENERATION
        assert not first.state.is_admitted(peer.node_id)
        route_request = mesh.RouteTableRequest(gen=0).SerializeToString()
        stream = await link.open_stream(StreamType.ROUTE_REQUEST)
        await stream.send_frame(route_request)
        assert await reset_code_of(stream) == mesh.MESH_ERROR_BAD_GENERATION


async def test_non_gossip_streams_before_admission_are_reset_and_the_connection_kept(first):
    async with RawPeer() as peer:
        link = await peer.connect(first)
        for stream_type in (StreamType.PROBE, StreamType.PEER_LEAVING, StreamType.PEER_DOWN):
            stream = await link.open_stream(stream_type)
            await stream.send_frame(mesh.Probe(gen=1).SerializeToString())
            assert await reset_code_of(stream) == mesh.MESH_ERROR_NOT_ADMITTED
        assert not link.is_closed
        reply = mesh.GossipFrame.FromString(
            await exchange(link, StreamType.GOSSIP, gossip_from(peer, first, certificate_for(first, peer)))
        )
        assert entry_ids(reply) == {first.node_id, peer.node_id}
        probe = mesh.Probe(gen=1, nonce=b"n").SerializeToString()
        assert await exchange(link, StreamType.PROBE, probe) == probe


async def test_oversized_length_prefix_resets_the_stream_and_the_node_keeps_serving(tmp_path, first):
    async with RawPeer() as peer, RawPeer() as bystander:
        link = await peer.connect(first)
        other_link = await bystander.connect(first)
        for stream_type in (StreamType.GOSSIP, StreamType.ROUTE_REQUEST):
            stream = await link.open_raw_stream()
            await stream.write(
                bytes([stream_type]) + (MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"\x00" * 1000
            )
            from meshnode.transport.framed import FramedStream

            code = await reset_code_of(FramedStream(stream, expect_stream_type=False))
            assert code == mesh.MESH_ERROR_FRAME_TOO_LARGE
        assert not link.is_closed
        assert (await route_table(link)).gen == 1  # the same connection still works
        assert (await route_table(other_link)).gen == 1  # and so do other peers
        joiner = await start_joiner(tmp_path, "after", first)
        await joiner.shutdown()


async def test_forged_peer_leaving_is_rejected_without_state_change(tmp_path, first):
    victim = await start_joiner(tmp_path, "victim", first)
    try:
        async with RawPeer() as peer:
            link = await peer.connect(first)
            await exchange(link, StreamType.GOSSIP, gossip_from(peer, first, certificate_for(first, peer)))
            assert first.state.is_admitted(peer.node_id)
            forged = mesh.PeerLeaving(peer_id=victim.node_id, gen=1).SerializeToString()
            stream = await link.open_stream(StreamType.PEER_LEAVING)
            await stream.send_frame(forged)
            stream.finish()
            assert await reset_code_of(stream) == mesh.MESH_ERROR_SENDER_MISMATCH
            assert victim.node_id in first.state.table and first.state.is_admitted(victim.node_id)
            # A genuine PeerLeaving removes exactly its sender, at once.
            genuine = mesh.PeerLeaving(peer_id=peer.node_id, gen=1).SerializeToString()
            assert await exchange(link, StreamType.PEER_LEAVING, genuine) is None
            assert peer.node_id not in first.state.table and not first.state.is_admitted(peer.node_id)
            assert victim.node_id in first.state.table
    finally:
        await victim.shutdown()


async def test_peer_down_is_probed_before_anyone_is_removed(tmp_path, first):
    alive = await start_joiner(tmp_path, "alive", first)
    try:
        async with RawPeer() as peer:
            link = await peer.connect(first)
            await exchange(link, StreamType.GOSSIP, gossip_from(peer, first, certificate_for(first, peer)))
            about_first = mesh.PeerDown(peer_id=first.node_id, gen=1).SerializeToString()
            stream = await link.open_stream(StreamType.PEER_DOWN)
            await stream.send_frame(about_first)
            stream.finish()
            assert await reset_code_of(stream) == mesh.MESH_ERROR_SELF_REPORT
            about_alive = mesh.PeerDown(peer_id=alive.node_id, gen=1).SerializeToString()
            assert await exchange(link, StreamType.PEER_DOWN, about_alive) is None
            await asyncio.sleep(first.config.probe_timeout + 0.5)
            assert alive.node_id in first.state.table  # the probe answered: nothing removed
    finally:
        await alive.shutdown()


# -- liveness -----------------------------------------------------------------------------------------------


async def test_clean_shutdown_removes_the_node_at_once_via_peer_leaving(tmp_path):
    # Slow heartbeats: only PeerLeaving can explain a prompt removal.
    first = await start_first_node(tmp_path, heartbeat_interval=30.0, peer_timeout=300.0)
    leaver = await start_joiner(tmp_path, "leaver", first, heartbeat_interval=30.0)
    try:
        await eventually(lambda: leaver.node_id in first.state.table)
        await leaver.shutdown()
        assert leaver.node_id not in first.state.table
        assert first.state.table.tombstone(leaver.node_id).reason == "left the mesh"
    finally:
        await first.shutdown()


async def test_a_crashed_node_is_dropped_after_probing_by_everyone(tmp_path, first):
    second = await start_joiner(tmp_path, "second", first)
    crashed = await start_joiner(tmp_path, "crashed", first)
    try:
        await eventually(
            lambda: crashed.node_id in second.state.table and crashed.node_id in first.state.table
        )
        # Crash: the socket goes away with no PeerLeaving and no CONNECTION_CLOSE.
        for task in crashed.background_tasks:
            task.cancel()
        # Fault injection: nothing public drops a socket without closing its connections.
        crashed.endpoint._transport.abort()
        await eventually(lambda: crashed.node_id not in first.state.table, timeout=15)
        await eventually(lambda: crashed.node_id not in second.state.table, timeout=15)
        assert "probe failed" in first.state.table.tombstone(crashed.node_id).reason
        assert second.node_id in first.state.table and first.node_id in second.state.table
    finally:
        await second.shutdown()


async def test_streams_the_peer_abandons_do_not_exhaust_the_connection(first):
    async with RawPeer() as peer:
        link = await peer.connect(first)
        for _ in range(200):  # more than the 128 streams a QUIC peer may have open at once
            stream = await link.open_raw_stream()
            await stream.write(bytes([StreamType.GOSSIP]) + (100).to_bytes(4, "little") + b"partial")
            stream.reset(0x1)  # in the same packet as the data: the node sees STOP_SENDING first
        assert (await route_table(link)).mesh_id == first.mesh_id
        await eventually(lambda: not any(link.stream_count for link in first.endpoint.links))


async def test_what_a_node_serves_reaches_its_peers(tmp_path, first):
    joiner = await start_joiner(tmp_path, "server", first)
    try:
        # With the range's speed: it travels in the joiner's signed record like the rest.
        speed = mesh.StageSpeed(decode_us_per_token=40_000, source=mesh.STAGE_SPEED_SOURCE_CALIBRATED)
        joiner.set_serving(
            mesh.ServedShard(
                model_name="m", shard_range={"start_layer": 0, "end_layer": 3}, total_layers=6, speed=speed
            )
        )
        joiner.set_capacity(mesh.Capacity(max_concurrent_sessions=4, max_context_tokens=4096))

        def announced():
            entry = first.state.table.get(joiner.node_id)
            return entry is not None and entry.announcement.serving.model_name == "m"

        await eventually(announced)
        # As the status socket serves it.
        peer = next(p for p in first.status().to_json()["peers"] if p["short_id"] == joiner.identity.short_id)
        assert peer["serving"] == {
            "model": "m",
            "start_layer": 0,
            "end_layer": 3,
            "total_layers": 6,
            "model_digest": "",
            "numerics": "",
            "state": "serving",
            "decode_ms_per_token": 40.0,
            "prefill_ms_per_token": None,
            "speed_source": "calibrated",
            "speed_samples": 0,
        }
        assert peer["capacity"]["max_concurrent_sessions"] == 4
        async with RawPeer() as stranger:
            table = await route_table(await stranger.connect(first))
        assert {e.model for e in table.entries} == {"", "m"}
    finally:
        await joiner.shutdown()
