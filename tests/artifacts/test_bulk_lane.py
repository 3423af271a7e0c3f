"""The bulk lane: artifacts over TLS on TCP between real nodes, authenticated with their node keys.

Each holder listens on TCP at its QUIC port number (:class:`~meshnode.app.bulk_lane.NodeBulkLane`);
the joiner fetches through :class:`~meshnode.artifacts.bulk_lanes.BulkLanes`, which picks the
lane per source: TLS/TCP to a peer reached directly, QUIC to one reached through a relay or
whose lane fails. Every byte is verified against the manifest either way.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest
from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_relay_server
from helpers.polling import eventually

from meshnode.app.bulk_lane import NodeBulkLane
from meshnode.artifacts.bulk_lanes import BulkLanes
from meshnode.artifacts.fetcher import IN_FLIGHT_PER_SOURCE, TransferError, fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import FullModel
from meshnode.artifacts.protocol import encode_manifest_query, parse_reply
from meshnode.artifacts.schedule import Quarantine
from meshnode.artifacts.store import ArtifactStore
from meshnode.gen.meshnode.v1 import artifacts_pb2 as pb
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node
from meshnode.transport.base import LinkClosed
from meshnode.transport.framed import FramedStream
from meshnode.transport.tls_lane import LaneContexts, TlsStream, dial_lane
from meshnode.wire.framing import StreamType

from .lane_nodes import LanePeer, free_on_tcp_too, lanes_of, quic_port, serve_on_lane
from .transfer_nodes import (
    CUT_TENSOR,
    CuttingHolding,
    FlippingHolding,
    head_range,
    mesh_of,
    nbytes,
    paced,
    serve,
)

pytestmark = pytest.mark.timeout(60)


async def manifest_over_lane(contexts: LaneContexts, holder: Node, root: str) -> pb.ArtifactReply | None:
    """The reply to a manifest query on a fresh lane connection; ``None`` when it was refused."""
    stream: TlsStream | None = None
    try:
        connection = await dial_lane("127.0.0.1", quic_port(holder), contexts, holder.node_id, timeout=5)
        stream = connection.stream()
        framed = FramedStream(stream, expect_stream_type=False, stream_type=StreamType.ARTIFACT)
        await stream.write(bytes((int(StreamType.ARTIFACT),)))
        await framed.send_frame(encode_manifest_query(bytes.fromhex(root)))
        body = await framed.recv_frame(timeout=5)
    except (LinkClosed, ssl.SSLError, ConnectionError):
        # TLS 1.3: the client's side of the handshake ends before the server has judged its
        # certificate, so a refusal may show only on the first read.
        return None
    finally:
        if stream is not None:
            stream.close()
    return None if body is None else parse_reply(body)


async def test_a_direct_peer_serves_the_manifest_and_tensors_over_tls_on_its_own_port(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        try:
            assert source.lane.server.listener.local_address[1] == quic_port(holder)
            lanes = lanes_of(joiner)
            manifest, blob = await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
            assert manifest == tiny_manifest
            wanted = head_range(manifest, 3)
            with ArtifactStore(tmp_path / "store").open(manifest, blob) as partial:
                report = await fetch_tensors(lanes.open_link, partial, wanted, [source.id])
                assert partial.verified == frozenset(wanted)
            assert lanes.lanes[source.id] == f"TLS/TCP 127.0.0.1:{quic_port(holder)}"
            assert report.quarantined == {} and report.failed_sources == {}
            # The same serving code paid the same accounts: the tensors and the blob, nothing else.
            assert source.server.uploaded_bytes == nbytes(manifest, wanted) + len(blob)
            # Every request was an exchange on the lane (manifest, blob, the holdings query, each
            # tensor), carried by connections reused one request after another: no more of them
            # than the fetch had requests in flight at once.
            listener = source.lane.server.listener
            assert listener.exchanges[joiner.node_id] == 3 + len(wanted)
            assert listener.served[joiner.node_id] <= IN_FLIGHT_PER_SOURCE
            lanes.close()
        finally:
            await source.lane.close()


async def test_a_stranger_is_refused_in_the_handshake_and_never_reaches_the_server(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, _member):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        listener = source.lane.server.listener
        try:
            stranger = LaneContexts(NodeIdentity.generate())
            assert await manifest_over_lane(stranger, holder, tiny_manifest.root) is None
            # Its handshake began and failed inside OpenSSL: nothing was served, nothing refused later.
            assert listener.handshakes_begun == 1
            assert listener.served == {} and listener.refusals == {} and source.server.refusals == {}
            assert listener.connections_of(stranger.identity.node_id) == 0
        finally:
            await source.lane.close()


async def test_a_trusted_key_that_the_mesh_has_not_admitted_is_refused_after_the_handshake(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, member):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        listener = source.lane.server.listener
        try:
            outsider = LaneContexts(NodeIdentity.generate())
            # Its certificate passes (as a removed member's would): admission still says no.
            source.lane.contexts.trust([outsider.identity.node_id])
            assert await manifest_over_lane(outsider, holder, tiny_manifest.root) is None
            await eventually(lambda: listener.refusals["not_admitted"] == 1, what="admission refused")
            assert listener.served == {} and source.server.refusals == {}
            # An admitted member on the same lane is served.
            reply = await manifest_over_lane(LaneContexts(member.identity), holder, tiny_manifest.root)
            assert reply is not None and reply.WhichOneof("kind") == "manifest"
        finally:
            await source.lane.close()


async def test_a_server_whose_key_is_not_the_expected_node_is_refused_and_the_fetch_goes_over_quic(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 3, free_on_tcp_too) as (holder, impostor, joiner):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        other = await serve_on_lane(impostor, FullModel(tiny_model))
        try:
            contexts = LaneContexts(joiner.identity)
            with pytest.raises(ssl.SSLCertVerificationError):
                await dial_lane("127.0.0.1", quic_port(impostor), contexts, holder.node_id, timeout=5)
            # The joiner is told the holder's lane is at the impostor's port: the handshake fails,
            # and the holder's tensors come over its QUIC link instead.
            lanes = BulkLanes(joiner.get_link, contexts, lambda link: ("127.0.0.1", quic_port(impostor)))
            wanted = head_range(tiny_manifest, 1)
            with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
                report = await fetch_tensors(lanes.open_link, partial, wanted, [source.id])
                assert partial.verified == frozenset(wanted)
            assert lanes.lanes[source.id].startswith("QUIC (bulk lane failed: SSLCertVerificationError")
            assert report.quarantined == {} and report.failed_sources == {}
            assert other.lane.server.listener.served == {}
            assert source.server.uploaded_bytes == nbytes(tiny_manifest, wanted)
        finally:
            await source.lane.close()
            await other.lane.close()


async def test_a_relayed_only_peer_is_fetched_from_over_quic(tmp_path: Path, tiny_model, tiny_manifest):
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    holder = first_member(tmp_path / "holder", relay_only_config(relay, listen=free_on_tcp_too()), mesh_key)
    joiner: Node | None = None
    source: LanePeer | None = None
    try:
        await holder.start()
        source = await serve_on_lane(holder, FullModel(tiny_model))
        invite = invite_from(holder, relays=holder.state.membership.relays)
        joiner = Node(
            NodeIdentity.generate(), DataDir(tmp_path / "joiner"), relay_only_config(), invite=invite
        )
        await joiner.start()
        await joiner.join()
        await eventually(
            lambda: holder.node_id in joiner.state.table and joiner.node_id in holder.state.table
        )
        lanes = lanes_of(joiner)
        manifest, blob = await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
        wanted = [t.name for t in manifest.tensors if t.name.startswith(("blk.4.", "output"))]
        with ArtifactStore(tmp_path / "store").open(manifest, blob) as partial:
            report = await fetch_tensors(lanes.open_link, partial, wanted, [source.id])
            assert partial.verified == frozenset(wanted)
        assert lanes.lanes[source.id].startswith("QUIC (relay ")
        assert source.lane.server.listener.served == {} and report.failed_sources == {}
        assert source.server.uploaded_bytes == nbytes(manifest, wanted) + len(blob)
    finally:
        if joiner is not None:
            await joiner.shutdown()
        if source is not None:
            await source.lane.close()
        await holder.shutdown()
        await server.close()


async def test_a_tensor_cut_off_over_the_lane_resumes_by_range_over_the_lane(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    index = next(i for i, t in enumerate(tiny_manifest.tensors) if t.name == CUT_TENSOR)
    size = tiny_manifest.tensor(CUT_TENSOR).nbytes
    cut_at = 16 * 4096
    async with mesh_of(tmp_path, 3, free_on_tcp_too) as (cutting_node, honest_node, joiner):
        cutting = await serve_on_lane(
            cutting_node, CuttingHolding(FullModel(tiny_model), index, cut_at), **paced()
        )
        honest = await serve_on_lane(honest_node, FullModel(tiny_model), chunk_bytes=4096)
        try:
            lanes = lanes_of(joiner)
            store = ArtifactStore(tmp_path / "store")
            with store.open(tiny_manifest, tiny_metadata) as partial, pytest.raises(TransferError):
                await fetch_tensors(lanes.open_link, partial, [CUT_TENSOR], [cutting.id])
            assert cutting.server.uploaded_bytes == cut_at
            with store.open(tiny_manifest, tiny_metadata) as partial:
                kept = partial.unfinished_bytes(CUT_TENSOR)
            # Whole chunks the joiner had read when the source aborted the connection.
            assert 0 < kept <= cut_at and kept % 4096 == 0
            with store.open(tiny_manifest, tiny_metadata) as partial:
                report = await fetch_tensors(lanes.open_link, partial, [CUT_TENSOR], [honest.id])
                assert partial.verified == frozenset([CUT_TENSOR])
            # The rest only, asked for by range.
            assert honest.server.uploaded_bytes == size - kept
            assert report.quarantined == {} and report.fetched == (CUT_TENSOR,)
            assert lanes.lanes[cutting.id].startswith("TLS/TCP") and lanes.lanes[honest.id].startswith(
                "TLS/TCP"
            )
        finally:
            await cutting.lane.close()
            await honest.lane.close()


async def test_a_source_lying_over_the_lane_is_quarantined_and_the_fetch_completes(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 3, free_on_tcp_too) as (honest_node, liar_node, joiner):
        honest = await serve_on_lane(honest_node, FullModel(tiny_model))
        liar = await serve_on_lane(liar_node, FlippingHolding(FullModel(tiny_model)))
        try:
            lanes = lanes_of(joiner)
            wanted = head_range(tiny_manifest, 2)
            quarantine = Quarantine()
            with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
                report = await fetch_tensors(
                    lanes.open_link, partial, wanted, [liar.id, honest.id], quarantine=quarantine
                )
                assert partial.verified == frozenset(wanted)
            assert liar.id in quarantine and "does not match" in report.quarantined[liar.id]
            assert honest.id not in quarantine
            assert lanes.lanes[liar.id].startswith("TLS/TCP")
            assert liar.server.uploaded_bytes <= 2 * max(t.nbytes for t in tiny_manifest.tensors)
        finally:
            await honest.lane.close()
            await liar.lane.close()


async def test_one_fetch_mixes_a_lane_source_and_a_quic_source(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 3, free_on_tcp_too) as (lane_node, quic_node, joiner):
        on_lane = await serve_on_lane(lane_node, FullModel(tiny_model))
        # This one has no lane listening: its TCP port refuses, so it is asked over QUIC.
        on_quic = serve(quic_node, FullModel(tiny_model))
        try:
            lanes = lanes_of(joiner)
            wanted = [t.name for t in tiny_manifest.tensors]
            with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
                report = await fetch_tensors(lanes.open_link, partial, wanted, [on_lane.id, on_quic.id])
                assert partial.verified == frozenset(wanted)
            assert lanes.lanes[on_lane.id].startswith("TLS/TCP")
            assert lanes.lanes[on_quic.id].startswith("QUIC (bulk lane failed: ConnectionRefusedError")
            assert on_lane.server.uploaded_bytes > 0 and on_quic.server.uploaded_bytes > 0
            assert on_lane.server.uploaded_bytes + on_quic.server.uploaded_bytes == nbytes(
                tiny_manifest, wanted
            )
            assert report.quarantined == {} and report.failed_sources == {}
        finally:
            await on_lane.lane.close()


async def test_a_tcp_port_taken_leaves_the_node_serving_artifacts_over_quic(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        source = serve(holder, FullModel(tiny_model))
        # Bound, not listening: the lane cannot bind it, and a connection to it is refused.
        taken = socket.socket()
        taken.bind(("127.0.0.1", quic_port(holder)))
        try:
            lane = NodeBulkLane(holder, source.server)
            await lane.start(holder)
            assert not lane.listening
            lanes = lanes_of(joiner)
            manifest, _ = await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
            assert manifest == tiny_manifest
            assert lanes.lanes[source.id].startswith("QUIC (bulk lane failed")
            await lane.close()
        finally:
            taken.close()


async def test_a_source_without_a_lane_address_yet_gets_its_lane_once_it_has_one(tmp_path):
    # The lane found for a QUIC link is kept while that link is the node's; no lane is never kept,
    # so a source whose announcement had not come in yet is looked at again on the next tensor.
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        address: tuple[str, int] | None = None
        asked = 0

        def address_of(link) -> tuple[str, int] | None:
            nonlocal asked
            asked += 1
            return address

        lanes = BulkLanes(joiner.get_link, LaneContexts(joiner.identity), address_of)
        quic = await joiner.get_link(holder.node_id)
        assert await lanes.open_link(holder.node_id) is quic
        assert lanes.lanes[holder.node_id].startswith("QUIC (")
        address = ("127.0.0.1", quic_port(holder))
        lane = await lanes.open_link(holder.node_id)
        assert lane is not quic and lane.description.startswith("tls 127.0.0.1:")
        assert await lanes.open_link(holder.node_id) is lane
        assert asked == 2
        lanes.lane_failed(holder.node_id, address, "refused")
        assert await lanes.open_link(holder.node_id) is quic
