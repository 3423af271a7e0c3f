"""One validator per mesh message, called right after decoding.

Each raises :class:`~meshnode.wire.mesh_refusal.MeshRefusal` with the exact code. Size
limits bound what a peer can make us hold (the 8 MiB frame cap bounds bytes;
these bound counts and strings so a frame cannot fill the peer table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from meshnode.identity import NODE_ID_BYTES
from meshnode.transport.addresses import is_valid_address
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

MAX_PEERS_PER_FRAME = 256
MAX_ADDRESSES = 8
MAX_RELAYS = 8
MAX_SUBPROTOCOLS = 16
MAX_TEXT = 256
MAX_NONCE = 32
# Revocations one frame may carry: the most a node keeps (meshnode.membership.revocation).
MAX_REVOCATIONS_PER_FRAME = 4096
# Audit evidence reports one frame may carry: the most a node keeps (meshnode.audit.evidence_book).
MAX_EVIDENCE_PER_FRAME = 64
# Delta gossip (meshnode.mesh.digest_gossip): buckets in one summary, versions in one reply
# (about 50 bytes each), and records or revocations wanted in one frame.
MAX_DIGEST_BUCKETS = 1024
MAX_DIGEST_ENTRIES_PER_FRAME = 1024
# A digest names a node by this many first bytes of its id, and says a bucket's hash or an
# incarnation by a tag of this many bytes (meshnode.mesh.digest_gossip).
DIGEST_PREFIX_BYTES = 4
DIGEST_TAG_BYTES = 2
MAX_WANTED_PER_FRAME = MAX_PEERS_PER_FRAME
# Suspicions one digest frame passes on (meshnode.mesh.failure_detector).
MAX_SUSPECTED_PER_FRAME = 16
# The slowest step a node may announce for its range (ServedShard.speed), per token: a minute.
# A stage slower than that serves no one, and the bound keeps a head's route costs finite.
MAX_STAGE_US_PER_TOKEN = 60_000_000
_STAGE_SPEED_SOURCES = frozenset(
    {mesh.STAGE_SPEED_SOURCE_CALIBRATED, mesh.STAGE_SPEED_SOURCE_MEASURED, mesh.STAGE_SPEED_SOURCE_ESTIMATED}
)

M = TypeVar("M", bound=Message)


def decode(message_type: type[M], data: bytes) -> M:
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"{message_type.__name__} does not decode") from None


def check_generation(gen: int, what: str) -> None:
    if gen != NODE_PROTOCOL_GENERATION:
        raise MeshRefusal(
            mesh.MESH_ERROR_BAD_GENERATION, f"{what}.gen is {gen}, expected {NODE_PROTOCOL_GENERATION}"
        )


def check_node_id(value: bytes, what: str) -> None:
    if len(value) != NODE_ID_BYTES:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"{what} must be {NODE_ID_BYTES} bytes, got {len(value)}"
        )


def check_sender(value: bytes, authenticated_peer_id: bytes, what: str) -> None:
    check_node_id(value, what)
    if value != authenticated_peer_id:
        raise MeshRefusal(mesh.MESH_ERROR_SENDER_MISMATCH, f"{what} is not the authenticated peer")


def _check_text(value: str, what: str) -> None:
    if len(value) > MAX_TEXT:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"{what} longer than {MAX_TEXT} characters")


def validate_announcement(announcement: mesh.PeerAnnouncement) -> None:
    check_node_id(announcement.endpoint_id, "PeerAnnouncement.endpoint_id")
    if announcement.role == mesh.NODE_ROLE_HOST and not announcement.http_port:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "a HOST announcement needs http_port")
    if announcement.http_port > 65535:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "http_port out of range")
    for text, what in (
        (announcement.version, "version"),
        (announcement.hostname, "hostname"),
        (announcement.mesh_id, "mesh_id"),
        (announcement.serving.model_name, "serving.model_name"),
        (announcement.serving.numerics, "serving.numerics"),
    ):
        _check_text(text, what)
    if len(announcement.addresses) > MAX_ADDRESSES or len(announcement.relays) > MAX_RELAYS:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "too many addresses or relays")
    if len(announcement.observed_addresses) > MAX_ADDRESSES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "too many observed addresses")
    for address in (*announcement.addresses, *announcement.observed_addresses):
        if not is_valid_address(address):
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "announced address is not host:port")
    for relay in announcement.relays:
        check_node_id(relay.relay_id, "RelayEndpoint.relay_id")
        if not is_valid_address(relay.address):
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "relay address is not host:port")
    if len(announcement.subprotocols) > MAX_SUBPROTOCOLS:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "too many subprotocols")
    if announcement.HasField("serving"):
        shard_range = announcement.serving.shard_range
        total = announcement.serving.total_layers
        if shard_range.start_layer >= shard_range.end_layer or (total and shard_range.end_layer > total):
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "served layer range is empty or past the model")
        if announcement.serving.HasField("speed"):
            validate_stage_speed(announcement.serving.speed)


def validate_stage_speed(speed: mesh.StageSpeed) -> None:
    """A served range's announced step times: a decode time within (0, MAX], a prefill time
    within [0, MAX] (0: none measured yet) and a source that says how they were obtained."""
    if not 0 < speed.decode_us_per_token <= MAX_STAGE_US_PER_TOKEN:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED,
            f"serving.speed.decode_us_per_token {speed.decode_us_per_token} is not within "
            f"1..{MAX_STAGE_US_PER_TOKEN}",
        )
    if speed.prefill_us_per_token > MAX_STAGE_US_PER_TOKEN:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED,
            f"serving.speed.prefill_us_per_token {speed.prefill_us_per_token} is above "
            f"{MAX_STAGE_US_PER_TOKEN}",
        )
    if speed.source not in _STAGE_SPEED_SOURCES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"serving.speed.source {speed.source} is not known")


def validate_gossip_frame(frame: mesh.GossipFrame, authenticated_peer_id: bytes) -> None:
    """The frame-level checks, in the seed's order; the records inside are
    :func:`~meshnode.mesh.gossip_records.open_gossip_entries`'s."""
    check_generation(frame.gen, "GossipFrame")
    check_sender(frame.sender_id, authenticated_peer_id, "GossipFrame.sender_id")
    if len(frame.entries) > MAX_PEERS_PER_FRAME:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"more than {MAX_PEERS_PER_FRAME} peers in one frame")
    if len(frame.revocations) > MAX_REVOCATIONS_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_REVOCATIONS_PER_FRAME} revocations in one frame"
        )
    if len(frame.evidence) > MAX_EVIDENCE_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_EVIDENCE_PER_FRAME} evidence reports in one frame"
        )


def _check_header(gen: int, sender_id: bytes, authenticated_peer_id: bytes, what: str) -> None:
    check_generation(gen, what)
    check_sender(sender_id, authenticated_peer_id, f"{what}.sender_id")


def validate_digest_open(frame: mesh.DigestOpen, authenticated_peer_id: bytes) -> None:
    _check_header(frame.gen, frame.sender_id, authenticated_peer_id, "DigestOpen")
    count = frame.bucket_count
    if not 0 < count <= MAX_DIGEST_BUCKETS or count & (count - 1):
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED,
            f"DigestOpen.bucket_count {count} is not a power of two within 1..{MAX_DIGEST_BUCKETS}",
        )
    if len(frame.bucket_tags) != DIGEST_TAG_BYTES * count:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "DigestOpen.bucket_tags does not match bucket_count")
    _check_suspected(frame.suspected, "DigestOpen")


def _check_suspected(suspected: Sequence[bytes], what: str) -> None:
    if len(suspected) > MAX_SUSPECTED_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_SUSPECTED_PER_FRAME} suspects in one {what}"
        )
    for node_id in suspected:
        check_node_id(node_id, f"{what}.suspected")


def validate_digest_reply(frame: mesh.DigestReply, authenticated_peer_id: bytes, bucket_count: int) -> None:
    """``bucket_count``: the one the opener's DigestOpen announced (the opener's own, not the peer's)."""
    _check_header(frame.gen, frame.sender_id, authenticated_peer_id, "DigestReply")
    listed, rest = divmod(len(frame.node_prefixes), DIGEST_PREFIX_BYTES)
    if rest:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "DigestReply.node_prefixes is not whole prefixes")
    if listed > MAX_DIGEST_ENTRIES_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_DIGEST_ENTRIES_PER_FRAME} digest entries in one frame"
        )
    if len(frame.incarnation_tags) != DIGEST_TAG_BYTES * listed or len(frame.sequences) != listed:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "DigestReply's version lists differ in length")
    if len(frame.listed_buckets) > bucket_count or any(b >= bucket_count for b in frame.listed_buckets):
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, "DigestReply lists a bucket the opener did not summarize"
        )
    _check_suspected(frame.suspected, "DigestReply")
    if len(frame.revocation_ids) > MAX_REVOCATIONS_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_REVOCATIONS_PER_FRAME} revocation ids in one frame"
        )


def validate_digest_push(frame: mesh.DigestPush, authenticated_peer_id: bytes) -> None:
    _check_header(frame.gen, frame.sender_id, authenticated_peer_id, "DigestPush")
    _check_records_and_revocations(len(frame.entries), len(frame.revocations), "DigestPush")
    wanted, rest = divmod(len(frame.wanted), DIGEST_PREFIX_BYTES)
    if rest:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "DigestPush.wanted is not whole prefixes")
    if wanted > MAX_WANTED_PER_FRAME or len(frame.wanted_revocations) > MAX_WANTED_PER_FRAME:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"more than {MAX_WANTED_PER_FRAME} wanted in one frame")


def validate_digest_records(frame: mesh.DigestRecords, authenticated_peer_id: bytes) -> None:
    _check_header(frame.gen, frame.sender_id, authenticated_peer_id, "DigestRecords")
    _check_records_and_revocations(len(frame.entries), len(frame.revocations), "DigestRecords")


def _check_records_and_revocations(records: int, revocations: int, what: str) -> None:
    if records > MAX_PEERS_PER_FRAME:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"more than {MAX_PEERS_PER_FRAME} records in one {what}")
    if revocations > MAX_WANTED_PER_FRAME:
        raise MeshRefusal(
            mesh.MESH_ERROR_MALFORMED, f"more than {MAX_WANTED_PER_FRAME} revocations in one {what}"
        )


def validate_route_request(request: mesh.RouteTableRequest, authenticated_peer_id: bytes) -> None:
    check_generation(request.gen, "RouteTableRequest")
    if request.requester_id:
        check_sender(request.requester_id, authenticated_peer_id, "RouteTableRequest.requester_id")


def validate_peer_down(report: mesh.PeerDown) -> None:
    check_generation(report.gen, "PeerDown")
    check_node_id(report.peer_id, "PeerDown.peer_id")


def validate_peer_leaving(notice: mesh.PeerLeaving) -> None:
    """Structure only; whether it names the sender is :func:`~meshnode.mesh.rules.resolve_peer_leaving`."""
    check_generation(notice.gen, "PeerLeaving")
    check_node_id(notice.peer_id, "PeerLeaving.peer_id")


def validate_probe(probe: mesh.Probe) -> None:
    check_generation(probe.gen, "Probe")
    if len(probe.nonce) > MAX_NONCE:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"Probe.nonce longer than {MAX_NONCE} bytes")
    if probe.target:
        check_node_id(probe.target, "Probe.target")


__all__ = [
    "DIGEST_PREFIX_BYTES",
    "DIGEST_TAG_BYTES",
    "MAX_DIGEST_BUCKETS",
    "MAX_DIGEST_ENTRIES_PER_FRAME",
    "MAX_EVIDENCE_PER_FRAME",
    "MAX_PEERS_PER_FRAME",
    "MAX_REVOCATIONS_PER_FRAME",
    "MAX_STAGE_US_PER_TOKEN",
    "MAX_SUSPECTED_PER_FRAME",
    "MAX_WANTED_PER_FRAME",
    "check_generation",
    "check_node_id",
    "check_sender",
    "decode",
    "validate_announcement",
    "validate_digest_open",
    "validate_digest_push",
    "validate_digest_records",
    "validate_digest_reply",
    "validate_gossip_frame",
    "validate_peer_down",
    "validate_peer_leaving",
    "validate_probe",
    "validate_route_request",
    "validate_stage_speed",
]
