"""Test-only: a shard server that signs its honest output and passes other bytes on.

:func:`forward_other_bytes` wraps one server's edge that hands a unit to the next hop, after the
worker signed its commitment (over what the engine computed) and its handoff: every unit's
hidden states are changed by one unit in the last place on their way out. What the handoff then
says is the test's choice (:class:`Handoff`): the honest one (of the computed bytes), one the
hop signs over the bytes it really sends, or none at all, as an older node sends. Nothing in the
shipped forwarding path can be switched to do this; the wrapper replaces the server's method on
one instance.
"""

from __future__ import annotations

import enum
from dataclasses import replace

import numpy as np

from meshnode.audit.commitment import hidden_digest
from meshnode.audit.handoff import sign_handoff
from meshnode.dataplane.actions import Forward
from meshnode.dataplane.edges.server import ShardServer
from meshnode.identity import NodeIdentity


class Handoff(enum.Enum):
    # The handoff the worker signed, of the bytes it computed (not those sent).
    COMPUTED = "computed"
    # A handoff the hop signs of the bytes it sends.
    SENT = "sent"
    # None, as a node from before handoffs sends.
    NONE = "none"


def altered(hidden: np.ndarray) -> np.ndarray:
    changed = np.array(hidden, dtype=np.float32)
    changed[0, 0] = np.nextafter(changed[0, 0], np.float32(np.inf))
    return changed


def forward_other_bytes(
    server: ShardServer, identity: NodeIdentity | None, handoff: Handoff, *, from_step: int = 0
) -> list[int]:
    """Make ``server`` pass on other bytes than it computed in every unit from step ``from_step``
    on (those before go on as the worker made them); returns the steps it did it for."""
    honest_forward = server._forward
    steps: list[int] = []

    def lying_forward(action: Forward) -> None:
        work = action.work
        if work.step < from_step:
            honest_forward(action)
            return
        sent = altered(work.hidden)
        if handoff is Handoff.SENT:
            assert identity is not None
            stated = sign_handoff(
                identity,
                session_id=action.session.session_id,
                epoch=action.session.epoch,
                step=work.step,
                work_id=work.work_id,
                sent_digest=hidden_digest(sent),
            )
        else:
            stated = work.handoff if handoff is Handoff.COMPUTED else None
        steps.append(work.step)
        honest_forward(replace(action, work=replace(work, hidden=sent, handoff=stated)))

    server._forward = lying_forward  # type: ignore[method-assign]
    return steps
