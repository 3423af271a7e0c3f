"""Relay wire pieces shared by the relay and the node's relay client.

Messages are ``RelayClientMessage``/``RelayServerMessage`` from
``proto/meshnode/v1/relay.proto``, framed ``[4-byte LE length][body]`` on one
QUIC stream (see that file for the sequence). One validator per direction runs
right after decoding, so the rest of the code sees only well-formed messages.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.gen.meshnode.v1 import mesh_pb2 as mesh
from meshnode.gen.meshnode.v1 import relay_pb2 as relay
from meshnode.identity import NODE_ID_BYTES, SIGNATURE_BYTES, NodeIdentity
from meshnode.membership.credentials import MAX_TOKEN_CHARS
from meshnode.transport.addresses import is_valid_address
from meshnode.wire.errors import (
    BufferLimitExceeded,
    FrameStalled,
    FrameTooLarge,
    FramingError,
    MeshnodeError,
)
from meshnode.wire.framing import MAX_FRAME_BYTES

RELAY_ALPN = "meshnode-relay/1"
RELAY_PROTOCOL_VERSION = 1
CHALLENGE_BYTES = 32
# A relayed payload may be as large as a mesh frame; the envelope gets room on top.
MAX_PAYLOAD_BYTES = MAX_FRAME_BYTES
ENVELOPE_ALLOWANCE = 64 * 1024
MAX_RELAY_FRAME_BYTES = MAX_PAYLOAD_BYTES + ENVELOPE_ALLOWANCE
# Before a client has registered, the only frame it may send is a registration:
# ids, a signature and a membership proof, whose largest part (an invite body)
# comes from an invite token of at most MAX_TOKEN_CHARS base64 characters. So a
# stranger can make the relay hold 16 KiB, not 8 MiB.
MAX_REGISTRATION_FRAME_BYTES = MAX_TOKEN_CHARS
MAX_MESH_ID_CHARS = 64
# Channel numbers are the nodes' business; the relay only bounds them.
MAX_CHANNEL = (1 << 62) - 1
MAX_REVOCATIONS_PER_MESSAGE = 1024
# What either end of a relay connection lets its one stream hold written and not yet sent; the
# rest waits in queues where a link's channels take turns (meshnode.relaywire.channel_turns),
# not in QUIC's, where a decode step would wait behind a transfer. What is in flight stays the
# congestion and flow control's to size.
MAX_UNSENT_BYTES = 64 * 1024

REGISTER_TAG = b"meshnode/v1/relay-register\0"

MALFORMED = relay.RELAY_ERROR_MALFORMED
PROTOCOL = relay.RELAY_ERROR_PROTOCOL
BAD_SIGNATURE = relay.RELAY_ERROR_BAD_SIGNATURE
IDENTITY_MISMATCH = relay.RELAY_ERROR_IDENTITY_MISMATCH
NOT_A_MEMBER = relay.RELAY_ERROR_NOT_A_MEMBER
DESTINATION_UNKNOWN = relay.RELAY_ERROR_DESTINATION_UNKNOWN
QUEUE_FULL = relay.RELAY_ERROR_QUEUE_FULL
PAYLOAD_TOO_LARGE = relay.RELAY_ERROR_PAYLOAD_TOO_LARGE
REPLACED = relay.RELAY_ERROR_REPLACED
REGISTRATION_TIMEOUT = relay.RELAY_ERROR_REGISTRATION_TIMEOUT
SHUTTING_DOWN = relay.RELAY_ERROR_SHUTTING_DOWN
OVERLOADED = relay.RELAY_ERROR_OVERLOADED
FRAME_STALLED = relay.RELAY_ERROR_FRAME_STALLED


def relay_code_name(code: int) -> str:
    try:
        return relay.RelayErrorCode.Name(code)
    except ValueError:
        return f"RELAY_ERROR_{code}"


class RelayRefused(MeshnodeError):
    """The relay refused something; ``code`` is a ``RelayErrorCode``."""

    def __init__(
        self,
        code: relay.RelayErrorCode,
        detail: str = "",
        *,
        membership_error: mesh.MeshErrorCode = mesh.MESH_ERROR_UNSPECIFIED,
        revocation: membership.Revocation | None = None,
    ) -> None:
        self.code = code
        self.detail = detail
        self.membership_error = membership_error
        self.revocation = revocation
        text = relay_code_name(code)
        if detail:
            text += f": {detail}"
        super().__init__(text)

    @property
    def code_name(self) -> str:
        return relay_code_name(self.code)

    def to_pb(self) -> relay.RelayRefusal:
        refusal = relay.RelayRefusal(
            code=self.code,
            detail=self.detail,
            membership_error=self.membership_error,
        )
        if self.revocation is not None:
            refusal.revocation.CopyFrom(self.revocation)
        return refusal

    @classmethod
    def from_pb(cls, refusal: relay.RelayRefusal) -> RelayRefused:
        revocation = refusal.revocation if refusal.HasField("revocation") else None
        return cls(
            refusal.code, refusal.detail, membership_error=refusal.membership_error, revocation=revocation
        )


class PayloadTooLarge(RelayRefused):
    """A well-formed send whose payload is over the limit: refuse the frame, keep the client."""

    def __init__(self, send: relay.RelaySend, limit: int) -> None:
        super().__init__(PAYLOAD_TOO_LARGE, f"payload of {len(send.payload)} bytes exceeds {limit}")
        self.send = send


def refusal_for_framing_error(exc: FramingError, *, registered: bool) -> RelayRefused:
    """What the relay tells a client whose byte stream it gave up on."""
    if isinstance(exc, FrameTooLarge):
        what = "a frame" if registered else "a frame before registration"
        return RelayRefused(PAYLOAD_TOO_LARGE, f"{what} of {exc.length} bytes exceeds {exc.limit}")
    if isinstance(exc, BufferLimitExceeded):
        return RelayRefused(OVERLOADED, str(exc))
    if isinstance(exc, FrameStalled):
        return RelayRefused(FRAME_STALLED, str(exc))
    return RelayRefused(MALFORMED, str(exc))


def registration_message(relay_id: bytes, challenge: bytes, node_id: bytes, mesh_id: str) -> bytes:
    return REGISTER_TAG + relay_id + challenge + node_id + mesh_id.encode("utf-8")


def sign_registration(identity: NodeIdentity, *, relay_id: bytes, challenge: bytes, mesh_id: str) -> bytes:
    return identity.sign(registration_message(relay_id, challenge, identity.node_id, mesh_id))


def _check_id(value: bytes, what: str) -> None:
    if len(value) != NODE_ID_BYTES:
        raise RelayRefused(MALFORMED, f"{what} must be {NODE_ID_BYTES} bytes")


def decode_client_message(
    body: bytes, *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> relay.RelayClientMessage:
    """Decode and validate one client frame; raises :class:`RelayRefused`."""
    try:
        message = relay.RelayClientMessage.FromString(body)
    except DecodeError:
        raise RelayRefused(MALFORMED, "relay frame does not decode") from None
    kind = message.WhichOneof("kind")
    if kind == "send":
        send = message.send
        _check_id(send.destination_id, "destination id")
        if send.channel > MAX_CHANNEL:
            raise RelayRefused(MALFORMED, "channel number out of range")
        if len(send.payload) > max_payload_bytes:
            raise PayloadTooLarge(send, max_payload_bytes)
    elif kind == "register":
        register = message.register
        _check_id(register.node_id, "node id")
        if len(register.signature) != SIGNATURE_BYTES:
            raise RelayRefused(MALFORMED, f"signature must be {SIGNATURE_BYTES} bytes")
        if not register.mesh_id or len(register.mesh_id) > MAX_MESH_ID_CHARS:
            raise RelayRefused(MALFORMED, "mesh id missing or too long")
    elif kind == "revocations":
        if len(message.revocations.revocations) > MAX_REVOCATIONS_PER_MESSAGE:
            raise RelayRefused(
                MALFORMED, f"more than {MAX_REVOCATIONS_PER_MESSAGE} revocations in one message"
            )
    else:
        raise RelayRefused(MALFORMED, "empty relay frame")
    return message


def decode_server_message(body: bytes) -> relay.RelayServerMessage:
    """Decode and validate one relay frame (client side); raises :class:`RelayRefused`."""
    try:
        message = relay.RelayServerMessage.FromString(body)
    except DecodeError:
        raise RelayRefused(MALFORMED, "relay frame does not decode") from None
    kind = message.WhichOneof("kind")
    if kind == "deliver":
        _check_id(message.deliver.source_id, "source id")
    elif kind == "challenge":
        _check_id(message.challenge.relay_id, "relay id")
        if len(message.challenge.challenge) != CHALLENGE_BYTES:
            raise RelayRefused(MALFORMED, f"challenge must be {CHALLENGE_BYTES} bytes")
    elif kind == "peer_gone":
        _check_id(message.peer_gone.peer_id, "peer id")
    elif kind in ("registered", "observed"):
        observed = getattr(message, kind).observed_address
        if observed and not is_valid_address(observed):
            raise RelayRefused(MALFORMED, "observed address is not host:port")
    elif kind is None:
        raise RelayRefused(MALFORMED, "empty relay frame")
    return message


def encode_send(destination_id: bytes, channel: int, payload: bytes, send_id: int = 0) -> bytes:
    return relay.RelayClientMessage(
        send=relay.RelaySend(destination_id=destination_id, channel=channel, payload=payload, send_id=send_id)
    ).SerializeToString()


def encode_revocations(revocations: list[membership.Revocation]) -> list[bytes]:
    """``RelayRevocations`` messages carrying ``revocations``, at most the per-message cap each."""
    step = MAX_REVOCATIONS_PER_MESSAGE
    return [
        relay.RelayClientMessage(
            revocations=relay.RelayRevocations(revocations=revocations[start : start + step])
        ).SerializeToString()
        for start in range(0, len(revocations), step)
    ]


def encode_deliver(source_id: bytes, channel: int, payload: bytes) -> bytes:
    return relay.RelayServerMessage(
        deliver=relay.RelayDeliver(source_id=source_id, channel=channel, payload=payload)
    ).SerializeToString()


__all__ = [
    "CHALLENGE_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_REGISTRATION_FRAME_BYTES",
    "MAX_RELAY_FRAME_BYTES",
    "MAX_UNSENT_BYTES",
    "RELAY_ALPN",
    "RELAY_PROTOCOL_VERSION",
    "PayloadTooLarge",
    "RelayRefused",
    "decode_client_message",
    "decode_server_message",
    "encode_deliver",
    "encode_send",
    "refusal_for_framing_error",
    "registration_message",
    "relay",
    "relay_code_name",
    "sign_registration",
]
