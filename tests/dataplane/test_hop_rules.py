"""What the admin's mesh policy asks of a serving hop (meshnode.dataplane.hop_rules): pure rules.

Under ``require_handoffs`` a unit of float32 hidden states without its sender's handoff is refused
(PAYLOAD_CORRUPT, the policy named); a bfloat16 boundary, on which no hop states what it sends,
and the head's own tokens are not. A route that forwards to a quarantined node after this hop is
refused (PAYLOAD_CORRUPT, the node named).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from meshnode.dataplane.handoff_check import REQUIRED_DETAIL, checked_handoff
from meshnode.dataplane.hop_rules import NO_RULES, FixedHopRules, quarantined_hop_refusal
from meshnode.dataplane.route import make_hop
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.identity import short_id
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


def unit(*, hidden: bool = True, dtype: int = shard.DTYPE_FLOAT32, stated_before: bool = False) -> Any:
    """The parts of a worker's Unit that the handoff check reads."""
    step_input = SimpleNamespace(
        token_ids=None if hidden else (1, 2),
        hidden=np.zeros((2, 4), dtype=np.float32) if hidden else None,
    )
    session = SimpleNamespace(
        upstream_states_handoffs=stated_before, role=SimpleNamespace(boundary_dtype=dtype)
    )
    return SimpleNamespace(session=session, input=step_input)


def test_no_policy_takes_a_unit_without_a_handoff_as_from_an_older_node():
    assert not NO_RULES.requires_handoffs()
    assert checked_handoff(None, unit(), required=NO_RULES.requires_handoffs()) is None


def test_a_required_handoff_left_out_is_refused_naming_the_policy():
    with pytest.raises(ShardProtocolError) as caught:
        checked_handoff(None, unit(), required=FixedHopRules(require_handoffs=True).requires_handoffs())
    assert caught.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert caught.value.detail == REQUIRED_DETAIL and "mesh policy requires handoffs" in REQUIRED_DETAIL


@pytest.mark.parametrize(
    "given",
    [
        pytest.param({"dtype": shard.DTYPE_BFLOAT16}, id="bfloat16 boundary: nobody states it"),
        pytest.param({"hidden": False}, id="the head's tokens: nothing to state"),
    ],
)
def test_the_requirement_leaves_units_no_hop_states_alone(given):
    assert checked_handoff(None, unit(**given), required=True) is None


def test_a_sender_that_stated_before_is_refused_with_its_own_detail_whatever_the_policy():
    with pytest.raises(ShardProtocolError) as caught:
        checked_handoff(None, unit(stated_before=True), required=False)
    assert caught.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert caught.value.detail == "the sender stopped stating what it sends"


def hops(*node_ids: bytes) -> list[dataplane.RouteHop]:
    return [make_hop(node_id, 2, 4, 2) for node_id in node_ids]


ACCUSED = b"\xcc" * 32
HONEST = b"\xaa" * 32


def test_a_route_forwarding_to_a_quarantined_node_is_refused_naming_it():
    refusal = quarantined_hop_refusal(hops(HONEST, ACCUSED), frozenset({ACCUSED}))
    assert refusal is not None and refusal.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert refusal.detail.startswith(f"the mesh policy quarantines {short_id(ACCUSED)} on audit evidence")


@pytest.mark.parametrize(
    "downstream, quarantined",
    [
        pytest.param(hops(HONEST), frozenset({ACCUSED}), id="the accused is not on the route"),
        pytest.param(hops(HONEST, ACCUSED), frozenset(), id="no quarantine"),
        pytest.param([], frozenset({ACCUSED}), id="the tail forwards to nobody"),
    ],
)
def test_a_route_without_a_quarantined_node_after_this_hop_is_served(downstream, quarantined):
    assert quarantined_hop_refusal(downstream, quarantined) is None


def test_no_rules_quarantine_nobody():
    assert NO_RULES.quarantined() == frozenset()
    assert FixedHopRules(quarantined_nodes=frozenset({ACCUSED})).quarantined() == {ACCUSED}
