"""The phase table alone (pure): which request a shard session stream may carry in which phase,
and the exact error that ends a stream for one out of place."""

from __future__ import annotations

import pytest

from meshnode.dataplane.stream_rules import Move, request_move
from meshnode.dataplane.worker_state import StreamPhase, StreamState
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

PAYLOAD_CORRUPT = shard.ERROR_CODE_PAYLOAD_CORRUPT
FLOW = shard.ERROR_CODE_FLOW_CONTROL_VIOLATION


def stream(phase: StreamPhase, *, answers: bool = False) -> StreamState:
    return StreamState(1, phase=phase, answer_only=answers)


@pytest.mark.parametrize(
    ("phase", "answers", "kind", "expected"),
    [
        (StreamPhase.AWAIT_OPEN, False, "open", Move.OPEN),
        (StreamPhase.AWAIT_OPEN, False, "chunk", (FLOW, "work sent before the session opened")),
        (StreamPhase.AWAIT_OPEN, False, "decode", (FLOW, "work sent before the session opened")),
        (StreamPhase.AWAIT_OPEN, False, "cancel", (PAYLOAD_CORRUPT, "cancel before SessionOpen")),
        (StreamPhase.AWAIT_OPEN, False, "", (PAYLOAD_CORRUPT, "empty request before SessionOpen")),
        (StreamPhase.OPEN, False, "open", (PAYLOAD_CORRUPT, "the session is already open")),
        (StreamPhase.OPEN, False, "chunk", Move.UNIT),
        (StreamPhase.OPEN, False, "decode", Move.UNIT),
        (StreamPhase.OPEN, False, "cancel", Move.CANCEL),
        (StreamPhase.OPEN, False, "release", Move.RELEASE),
        (StreamPhase.OPEN, False, "flow_control", Move.FLOW_CONTROL),
        (StreamPhase.OPEN, False, "", (PAYLOAD_CORRUPT, "empty request")),
        (StreamPhase.OPEN, True, "flow_control", Move.FLOW_CONTROL),
        (StreamPhase.OPEN, True, "decode", (FLOW, "an answer stream carries no work")),
        (StreamPhase.OPEN, True, "cancel", (FLOW, "an answer stream carries no work")),
        (StreamPhase.OPEN, True, "open", (FLOW, "an answer stream carries no work")),
    ],
)
def test_each_request_in_each_phase_leads_to_its_move_or_its_exact_refusal(phase, answers, kind, expected):
    move = request_move(stream(phase, answers=answers), kind)
    if isinstance(expected, Move):
        assert move is expected
    else:
        assert isinstance(move, ShardProtocolError)
        assert (move.code, move.detail) == expected


def test_every_request_kind_has_a_rule_in_every_phase_a_request_can_arrive_in():
    kinds = [field.name for field in shard.SessionRequest.DESCRIPTOR.oneofs_by_name["kind"].fields]
    for phase, answers in [
        (StreamPhase.AWAIT_OPEN, False),
        (StreamPhase.OPEN, False),
        (StreamPhase.OPEN, True),
    ]:
        for kind in [*kinds, ""]:
            assert isinstance(request_move(stream(phase, answers=answers), kind), Move | ShardProtocolError)
