"""Signed handoffs: what a hop says it sent to the next hop in one unit. Pure and synchronous.

A hop's commitment (:mod:`meshnode.audit.commitment`) states what it computed; what it then
passes on is other bytes, on another path. A hop that commits to its honest output and sends
something else would otherwise leave its neighbour's commitment (whose input is what arrived)
against its own, and no one could say which of the two lied. So a forwarding hop also signs,
once per unit, a :class:`~meshnode.wire.pb.shard.UnitHandoff`: the digest of the hidden states
it sent, in the form of its own output digest. It rides with the unit; the receiver checks it
against the bytes it was given and refuses the unit when they differ (a statement of other
bytes than those sent is the sender's lie, though only the receiver saw it), and otherwise
carries it to the head inside its own commitment. A sender's handoff that states other bytes
than its own commitment's output is then two statements of one node that contradict each
other: evidence against it that needs no witness (:mod:`meshnode.audit.evidence`).

Only FLOAT32 boundaries are stated: a narrower boundary dtype rounds what the hop computed, so
an honest handoff would differ from its output digest. A hop that sends no handoff (an older
node) is checked as before, never convicted for the absence.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from meshnode.audit.commitment import DIGEST_BYTES, hidden_digest
from meshnode.identity import NODE_ID_BYTES, NodeIdentity, verify_signature
from meshnode.wire.pb import shard

HANDOFF_DOMAIN = b"meshnode/v1/unit-handoff\0"
# A handoff is about 150 bytes with the ids a head makes; room is left for the longest ids a hop
# takes (a session id of 128 characters, a work id of the head's choosing), and anything larger
# is not one (never parsed further).
MAX_HANDOFF_BYTES = 1024
STATED_DTYPE = shard.DTYPE_FLOAT32


class HandoffRejected(Exception):
    """A signed handoff that does not decode, is malformed, or is not signed by the node it names."""


def states_handoffs(boundary_dtype: int) -> bool:
    """Whether a hop states what it sends on a route of ``boundary_dtype``."""
    return boundary_dtype == STATED_DTYPE


def sign_handoff(
    identity: NodeIdentity,
    *,
    session_id: str,
    epoch: int,
    step: int,
    work_id: str,
    sent_digest: bytes,
) -> shard.SignedHandoff:
    """This hop's signed statement that it sent, in one unit, the FLOAT32 hidden states whose
    :func:`~meshnode.audit.commitment.hidden_digest` is ``sent_digest``."""
    handoff = shard.UnitHandoff(
        node_id=identity.node_id,
        route_session_id=session_id,
        route_epoch=epoch,
        idempotency_step=step,
        work_id=work_id,
        boundary_dtype=STATED_DTYPE,
        sent_digest=sent_digest,
    )
    body = handoff.SerializeToString(deterministic=True)
    return shard.SignedHandoff(handoff=body, signature=identity.sign(HANDOFF_DOMAIN + body))


def open_handoff(signed: shard.SignedHandoff) -> shard.UnitHandoff:
    """The handoff in ``signed``, once its form and its signer's signature check out."""
    handoff = decode_handoff(signed)
    if not verify_signature(
        bytes(handoff.node_id), bytes(signed.signature), HANDOFF_DOMAIN + bytes(signed.handoff)
    ):
        raise HandoffRejected("the handoff is not signed by the node it names")
    return handoff


def decode_handoff(signed: shard.SignedHandoff) -> shard.UnitHandoff:
    """The handoff in ``signed`` once its form checks out, its signature NOT checked (for finding
    a contradiction cheaply; only :func:`open_handoff` makes it a statement)."""
    body = bytes(signed.handoff)
    if len(body) > MAX_HANDOFF_BYTES:
        raise HandoffRejected(f"a handoff of {len(body)} bytes (at most {MAX_HANDOFF_BYTES})")
    try:
        handoff = shard.UnitHandoff.FromString(body)
    except DecodeError:
        raise HandoffRejected("the handoff does not decode") from None
    if len(handoff.node_id) != NODE_ID_BYTES:
        raise HandoffRejected("the handoff's node_id is not a node id")
    if len(handoff.sent_digest) != DIGEST_BYTES:
        raise HandoffRejected(f"the handoff's digest is not {DIGEST_BYTES} bytes")
    return handoff


def same_unit(handoff: shard.UnitHandoff, *, session_id: str, epoch: int, step: int, work_id: str) -> bool:
    return (
        handoff.route_session_id == session_id
        and handoff.route_epoch == epoch
        and handoff.idempotency_step == step
        and handoff.work_id == work_id
    )


def check_received(
    signed: shard.SignedHandoff,
    *,
    session_id: str,
    epoch: int,
    step: int,
    work_id: str,
    received: np.ndarray,
) -> str | None:
    """Why the handoff that came with a unit does not state ``received`` (the FLOAT32 hidden
    states as decoded); None when it does.

    Its signature is not checked here: a receiver refuses bytes the sender did not state, and a
    handoff without the sender's signature states nothing, no more than the absent handoff of an
    older node, which is taken. Whoever acts on a handoff (the head, anyone checking evidence)
    checks the signature then; a unit is spared one Ed25519 verification on every hop."""
    try:
        handoff = decode_handoff(signed)
    except HandoffRejected as error:
        return str(error)
    if not same_unit(handoff, session_id=session_id, epoch=epoch, step=step, work_id=work_id):
        return "the sender's handoff names another unit"
    if handoff.boundary_dtype != STATED_DTYPE:
        return "the sender's handoff states another dtype"
    if handoff.sent_digest != hidden_digest(received):
        return "the sender's signed handoff states other bytes than it sent"
    return None


def contradicts(handoff: shard.UnitHandoff, commitment: shard.UnitCommitment) -> bool:
    """Whether one node's handoff and commitment for one unit state other bytes (both opened)."""
    return (
        handoff.node_id == commitment.node_id
        and same_unit(
            handoff,
            session_id=commitment.route_session_id,
            epoch=commitment.route_epoch,
            step=commitment.idempotency_step,
            work_id=commitment.work_id,
        )
        and handoff.boundary_dtype == STATED_DTYPE
        and handoff.sent_digest != commitment.output_digest
    )


__all__ = [
    "HANDOFF_DOMAIN",
    "MAX_HANDOFF_BYTES",
    "HandoffRejected",
    "check_received",
    "contradicts",
    "decode_handoff",
    "open_handoff",
    "same_unit",
    "sign_handoff",
    "states_handoffs",
]
