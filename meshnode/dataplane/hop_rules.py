"""What the admin's mesh policy asks of a serving hop, as the worker reads it. Pure.

The node's evidence keeper (:class:`meshnode.node.evidence_keeper.EvidenceKeeper`) answers from the
policy and the evidence it verified; a worker without a node (tests, a node of one) follows
:data:`NO_RULES`. The answers are read when they matter (a route at session open, a unit without a
handoff), so a policy or evidence learned from gossip applies to the next of them.

* :meth:`HopRules.requires_handoffs`: the policy's ``require_handoffs`` (handoff_check refuses a
  unit of float32 hidden states that comes without its sender's handoff);
* :meth:`HopRules.quarantined`: the members valid evidence convicts, where the policy quarantines
  on evidence, less those an admin cleared. A hop refuses a route that would forward to one of
  them (:func:`quarantined_hop_refusal`), so a head that has not learned the evidence yet cannot
  keep using the quarantined node through honest hops. Sessions already open keep their route
  until the head opens the next epoch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from meshnode.dataplane.errors import payload_corrupt
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.identity import short_id
from meshnode.wire.errors import ShardProtocolError


class HopRules(Protocol):
    def requires_handoffs(self) -> bool: ...

    def quarantined(self) -> frozenset[bytes]: ...


@dataclass(frozen=True)
class FixedHopRules:
    """Rules that do not change (no policy: nothing required, nobody quarantined)."""

    require_handoffs: bool = False
    quarantined_nodes: frozenset[bytes] = frozenset()

    def requires_handoffs(self) -> bool:
        return self.require_handoffs

    def quarantined(self) -> frozenset[bytes]:
        return self.quarantined_nodes


NO_RULES = FixedHopRules()


def quarantined_hop_refusal(
    downstream: Iterable[dataplane.RouteHop], quarantined: frozenset[bytes]
) -> ShardProtocolError | None:
    """PAYLOAD_CORRUPT when a hop after this one is quarantined (a set lookup a hop); else None."""
    if not quarantined:
        return None
    for hop in downstream:
        node_id = bytes(hop.node_id)
        if node_id in quarantined:
            # The id is this node's own rendering of one it holds evidence against, not peer text.
            return payload_corrupt(
                f"the mesh policy quarantines {short_id(node_id)} on audit evidence: "
                "this hop forwards to no quarantined node"
            )
    return None


__all__ = ["NO_RULES", "FixedHopRules", "HopRules", "quarantined_hop_refusal"]
