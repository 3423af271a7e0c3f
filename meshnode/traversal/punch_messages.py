"""The HOLE_PUNCH stream's messages (traversal.proto): built, read and checked in one place (pure).

Every message read is checked before anything acts on it: the generation, the number and form
of candidates, the length of a decline's detail. A peer that breaks them gets a MALFORMED
refusal (the dispatcher resets the stream with its code).
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import traversal_pb2 as traversal
from meshnode.mesh.validation import check_generation
from meshnode.transport.addresses import is_valid_address
from meshnode.traversal.candidates import MAX_CANDIDATES
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

MAX_DETAIL = 256


def offer(candidates: Sequence[str], nat_mapping: mesh.NatMapping) -> bytes:
    return traversal.PunchMessage(
        offer=traversal.PunchOffer(
            gen=NODE_PROTOCOL_GENERATION,
            candidates=list(candidates)[:MAX_CANDIDATES],
            nat_mapping=nat_mapping,
        )
    ).SerializeToString()


def declined(reason: traversal.PunchDeclineReason, detail: str, retry_after_s: float = 0.0) -> bytes:
    return traversal.PunchMessage(
        declined=traversal.PunchDeclined(
            reason=reason, detail=detail[:MAX_DETAIL], retry_after_ms=max(0, round(retry_after_s * 1000))
        )
    ).SerializeToString()


def sync() -> bytes:
    return traversal.PunchMessage(sync=traversal.PunchSync()).SerializeToString()


def result(reached: str) -> bytes:
    return traversal.PunchMessage(result=traversal.PunchResult(reached=reached)).SerializeToString()


def read(body: bytes, *, expect: tuple[str, ...]) -> traversal.PunchMessage:
    """One message of a kind in ``expect``, checked; raises a MALFORMED :class:`MeshRefusal`."""
    try:
        message = traversal.PunchMessage.FromString(body)
    except DecodeError:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "punch message does not decode") from None
    kind = message.WhichOneof("kind")
    if kind not in expect:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"punch message {kind} where {'/'.join(expect)} was due")
    if kind == "offer":
        _check_offer(message.offer)
    elif kind == "declined" and len(message.declined.detail) > MAX_DETAIL:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "punch decline detail too long")
    elif kind == "result" and message.result.reached and not is_valid_address(message.result.reached):
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "punch result is not host:port")
    return message


def _check_offer(offer: traversal.PunchOffer) -> None:
    check_generation(offer.gen, "PunchOffer")
    if len(offer.candidates) > MAX_CANDIDATES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"more than {MAX_CANDIDATES} punch candidates")
    for candidate in offer.candidates:
        if not is_valid_address(candidate):
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "punch candidate is not host:port")


def decline_reason_name(reason: int) -> str:
    """``backing off`` etc., for logs."""
    return traversal.PunchDeclineReason.Name(reason).removeprefix("PUNCH_DECLINE_").lower().replace("_", " ")


__all__ = ["MAX_DETAIL", "decline_reason_name", "declined", "offer", "read", "result", "sync"]
