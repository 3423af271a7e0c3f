"""A unit's handoff checked on arrival, against the input it came with (meshnode.audit.handoff).

The previous hop's signed statement of what it sent either states the hidden states this hop
was given, and then is kept for this hop's commitment, or the unit is refused: PAYLOAD_CORRUPT,
before anything is computed on it, so other bytes than the sender stated never pass silently.
A unit without one (an older node, or the head's own tokens) is taken as before, unless the same
sender already stated what it sent in this session: a hop that signs its handoffs signs one with
every unit it passes on, so one left out is refused too, or a liar would state the bytes of every
unit but those it changes. Under a mesh policy that requires handoffs
(:mod:`meshnode.dataplane.hop_rules`) no unit of hidden states is taken without one, so a hop that
never states what it sends cannot pass for an older node; the exception is a bfloat16 boundary,
on which no hop states what it sends (meshnode.audit.handoff.states_handoffs): the head chose that
boundary for the whole route, not the sender, so the requirement does not reach it. The signature is left to whoever acts on the handoff
(meshnode.audit.handoff.check_received says why).
"""

from __future__ import annotations

from meshnode.audit.handoff import check_received, states_handoffs
from meshnode.dataplane import errors
from meshnode.dataplane.worker_state import Unit
from meshnode.wire.pb import shard

REQUIRED_DETAIL = "the mesh policy requires handoffs: the sender stated nothing of the hidden states it sent"


def checked_handoff(
    handoff: shard.SignedHandoff | None, unit: Unit, *, required: bool = False
) -> shard.SignedHandoff | None:
    """``handoff`` once it states the input ``unit`` arrived with; None when there is none, none
    came before in the session and the policy does not require one (``required``); else
    PAYLOAD_CORRUPT."""
    session = unit.session
    if handoff is None:
        if session.upstream_states_handoffs:
            raise errors.payload_corrupt("the sender stopped stating what it sends")
        carries_hidden = unit.input is not None and unit.input.hidden is not None
        if required and carries_hidden and states_handoffs(session.role.boundary_dtype):
            raise errors.payload_corrupt(REQUIRED_DETAIL)
        return None
    hidden = None if unit.input is None else unit.input.hidden
    if hidden is None:
        raise errors.payload_corrupt("a handoff came with token ids, not hidden states")
    reason = check_received(
        handoff,
        session_id=session.session_id,
        epoch=session.epoch,
        step=unit.step,
        work_id=unit.work_id,
        received=hidden,
    )
    if reason is not None:
        raise errors.payload_corrupt(reason)
    session.upstream_states_handoffs = True
    return handoff


__all__ = ["REQUIRED_DETAIL", "checked_handoff"]
