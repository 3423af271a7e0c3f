"""The node's status report (typed, and the exact JSON the status socket serves) and its socket."""

from __future__ import annotations

import asyncio
import json
import logging
import stat

from helpers.mesh_helpers import FakeLink

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.store import MembershipState
from meshnode.mesh.state import MeshState
from meshnode.node.status_report import StatusReport, status_report
from meshnode.sansio import SECOND_NS
from meshnode.statussocket.client import ask_node
from meshnode.statussocket.server import StatusServer
from meshnode.wire.pb import mesh, shard

NOW = 1_800_000_000.0
NOW_NS = 1_800_000_000 * 1_000_000_000
# An instant of the monotonic clock that liveness runs on (its origin is arbitrary).
MONOTONIC_NS = 42 * SECOND_NS


def member(mesh_key: MeshKey, identity: NodeIdentity, address: str) -> MeshState:
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=NOW
    )
    return MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(
            incarnation=NOW_NS - 10**9,
            addresses=[address],
            role=mesh.NODE_ROLE_WORKER,
            version="0.test",
            directly_reachable=True,
        ),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
    )


def a_report_with_one_peer() -> tuple[StatusReport, MeshState, MeshState]:
    mesh_key = MeshKey.generate()
    a = member(mesh_key, NodeIdentity.generate(), "10.0.0.1:7447")
    b = member(mesh_key, NodeIdentity.generate(), "10.0.0.2:7447")
    b.local.serving.CopyFrom(
        mesh.ServedShard(
            model_name="tiny",
            total_layers=6,
            shard_range=shard.ShardRange(start_layer=3, end_layer=6),
            fingerprint=shard.Fingerprint(model_artifact_digest="sha256:abc"),
            numerics="f32",
            speed=mesh.StageSpeed(
                decode_us_per_token=31_250,
                prefill_us_per_token=2_500,
                samples=12,
                source=mesh.STAGE_SPEED_SOURCE_MEASURED,
            ),
        )
    )
    b.local.capacity.CopyFrom(mesh.Capacity(max_concurrent_sessions=4, max_context_tokens=4096))
    b.local.load.CopyFrom(mesh.Load(active_sessions=1, queued_chunks=2, kv_pressure=0.123456))
    b.local.relays.add(relay_id=b"\x09" * 32, address="relay.example:7448")
    a.receive_gossip(b.gossip_frame(a.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    link = FakeLink(b.node_id, dialed_here=True, at=1.0, name="quic 10.0.0.2:7447")
    report = status_report(
        a,
        relays=None,
        link_to={b.node_id: link}.get,
        stream_refusals={"MESH_ERROR_NOT_ADMITTED": 2},
        gossip_refusals={"MESH_ERROR_NO_CREDENTIAL": 1},
        started_at_ns=MONOTONIC_NS - 5 * SECOND_NS,
        api_url="http://127.0.0.1:8080",
        now_ns=MONOTONIC_NS + 1_500_000_000,
    )
    return report, a, b


def test_the_report_serializes_to_the_status_sockets_json():
    report, a, b = a_report_with_one_peer()
    assert report.to_json() == {
        "node": {
            "id": a.node_id.hex(),
            "short_id": report.node.short_id,
            "mesh_id": a.mesh_id,
            "member": True,
            "addresses": ["10.0.0.1:7447"],
            "directly_reachable": True,
            "relays": [],
            "incarnation": NOW_NS - 10**9,
            "heartbeat_seq": 0,
            "serving": None,
            "uptime_s": 6.5,
            "api_url": "http://127.0.0.1:8080",
            "capacity": {"max_concurrent_sessions": 0, "max_context_tokens": 0},
            "load": {"active_sessions": 0, "queued_chunks": 0, "kv_pressure": 0.0},
            "observed_addresses": [],
            "nat_mapping": "unknown",
            "hole_punching": "off",
        },
        "peers": [
            {
                "id": b.node_id.hex(),
                "short_id": report.peers[0].short_id,
                "role": "NODE_ROLE_WORKER",
                "addresses": ["10.0.0.2:7447"],
                "directly_reachable": True,
                "relays": [{"id": "09" * 32, "address": "relay.example:7448"}],
                "serving": {
                    "model": "tiny",
                    "start_layer": 3,
                    "end_layer": 6,
                    "total_layers": 6,
                    "model_digest": "sha256:abc",
                    "numerics": "f32",
                    "state": "serving",
                    "decode_ms_per_token": 31.25,
                    "prefill_ms_per_token": 2.5,
                    "speed_source": "measured",
                    "speed_samples": 12,
                },
                "capacity": {"max_concurrent_sessions": 4, "max_context_tokens": 4096},
                "load": {"active_sessions": 1, "queued_chunks": 2, "kv_pressure": 0.1235},
                "link": "quic 10.0.0.2:7447",
                "admitted": True,
                "age_s": 1.5,
                "last_direct_s": 1.5,
                "incarnation": NOW_NS - 10**9,
                "heartbeat_seq": 0,
                "version": "0.test",
                "path": "public",
                "path_since_s": 42.5,
                "relay_bytes": 0,
            }
        ],
        "tombstones": 0,
        "refusals": {
            "streams": {"MESH_ERROR_NOT_ADMITTED": 2},
            "gossip": {"MESH_ERROR_NO_CREDENTIAL": 1},
            "records": {},
        },
        "sections": {},
        "membership": {},
        "evidence": {},
    }
    assert json.loads(json.dumps(report.to_json())) == report.to_json()


def test_a_peer_without_a_live_link_shows_none():
    mesh_key = MeshKey.generate()
    a = member(mesh_key, NodeIdentity.generate(), "10.0.0.1:7447")
    b = member(mesh_key, NodeIdentity.generate(), "10.0.0.2:7447")
    a.receive_gossip(b.gossip_frame(a.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    report = status_report(
        a,
        relays=None,
        link_to=lambda peer_id: None,
        stream_refusals={},
        gossip_refusals={},
        started_at_ns=MONOTONIC_NS,
        api_url=None,
        now_ns=MONOTONIC_NS,
    )
    (peer,) = report.peers
    assert peer.link is None and peer.serving is None and report.node.api_url is None


async def ask(path, line: bytes) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(line)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return json.loads(answer)


async def test_the_socket_answers_status_with_the_report_and_nothing_else(tmp_path):
    report, _, _ = a_report_with_one_peer()
    path = tmp_path / "data" / "control.sock"
    server = StatusServer(path, lambda: report)
    await server.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert await ask(path, b"status\n") == report.to_json()
        assert await ask(path, b"shutdown\n") == {"error": "unknown request"}
    finally:
        server.close()
    assert not path.exists()


async def test_a_data_directory_deeper_than_af_unix_allows_still_answers_status(tmp_path):
    # A data directory under a long home or project path used to leave the node without a status
    # socket: `meshnode status` and `invite` then said no node was running.
    path = tmp_path / ("d" * 60) / ("e" * 60) / "control.sock"
    assert len(str(path)) > 107
    report, _, _ = a_report_with_one_peer()
    server = StatusServer(path, lambda: report)
    await server.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert await asyncio.to_thread(ask_node, path.parent, "status") == report.to_json()
    finally:
        server.close()


async def test_a_socket_that_cannot_be_made_is_a_warning(tmp_path, caplog):
    path = tmp_path / "data" / ("s" * 120)  # a name longer than AF_UNIX allows, however reached
    server = StatusServer(path, lambda: a_report_with_one_peer()[0])
    with caplog.at_level(logging.WARNING, logger="meshnode.statussocket"):
        await server.start()
    assert "no status socket at" in caplog.text
    server.close()  # nothing to close, and no error
