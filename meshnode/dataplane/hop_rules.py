"""What the admin's mesh policy asks of a serving hop, as the worker reads it. Pure.

The node's evidence keeper (:class:`meshnode.node.evidence_keeper.EvidenceKeeper`) answers from the
policy it verified; a worker without a node (tests, a node of one) follows :data:`NO_RULES`. The
answer is read when it matters (a unit without a handoff), so a policy learned from gossip applies
to the next unit.

* :meth:`HopRules.requires_handoffs`: the policy's ``require_handoffs`` (handoff_check refuses a
  unit of float32 hidden states that comes without its sender's handoff).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class HopRules(Protocol):
    def requires_handoffs(self) -> bool: ...


@dataclass(frozen=True)
class FixedHopRules:
    """Rules that do not change (no policy: nothing required)."""

    require_handoffs: bool = False

    def requires_handoffs(self) -> bool:
        return self.require_handoffs


NO_RULES = FixedHopRules()


__all__ = ["NO_RULES", "FixedHopRules", "HopRules"]
