"""The committed generated code and golden vectors must match their sources."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from meshnode.wire.conformance import golden_hidden_states
from meshnode.wire.pb import mesh, shard
from meshnode.wire.tensor_codec import decode_bundle

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "vectors" / "session_request_golden.binpb"


def run_check(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_generated_protobuf_code_matches_proto_sources():
    result = run_check("generate_proto.py")
    assert result.returncode == 0, result.stderr


def test_golden_vectors_match_their_generator():
    result = run_check("generate_vectors.py")
    assert result.returncode == 0, result.stderr


def test_golden_session_request_parses_and_verifies():
    data = GOLDEN.read_bytes()
    request = shard.SessionRequest.FromString(data)
    assert request.WhichOneof("kind") == "chunk"
    envelope = request.chunk.envelope
    assert envelope.schema_version == shard.SCHEMA_VERSION_1
    assert envelope.route_session_id == "rs-00000000-golden"
    assert (envelope.route_epoch, envelope.idempotency_step) == (3, 2)
    assert envelope.shard_range.effective_start_layer == 6
    assert envelope.cache_expectation.expected_past_len == 4
    assert envelope.chunk.final_chunk
    hidden = request.chunk.bundle.tensors[0]
    assert len(hidden.fragments) == 4 and hidden.fragments[3].byte_offset == 768
    assert hidden.checksum.algorithm == shard.CHECKSUM_ALGORITHM_CRC32C
    decoded = decode_bundle(request.chunk.bundle)
    assert np.array_equal(decoded["hidden_states"].array, golden_hidden_states())
    assert decoded["position_ids"].array.tolist() == [4, 5, 6, 7]
    assert request.SerializeToString(deterministic=True) == data


def test_unknown_fields_from_a_newer_peer_survive_a_hop():
    # A shard forwards activations: silently stripping fields would corrupt a route.
    data = GOLDEN.read_bytes() + b"\xa8\x06\x01"  # field 101, varint 1
    request = shard.SessionRequest.FromString(data)
    assert request.SerializeToString() == data


def test_mesh_schema_names_the_seed_messages():
    names = set(mesh.DESCRIPTOR.message_types_by_name)
    assert {"GossipFrame", "PeerAnnouncement", "RouteTableRequest", "RouteTable"} <= names
    assert {"PeerDown", "PeerLeaving", "MeshSubprotocolOpen"} <= names
    gossip = mesh.GossipFrame.DESCRIPTOR.fields_by_name
    assert gossip["gen"].number == 1 and gossip["sender_id"].number == 3
    served = mesh.ServedShard.DESCRIPTOR.fields_by_name
    assert served["fingerprint"].message_type.full_name == "meshnet.shard.v1.Fingerprint"
