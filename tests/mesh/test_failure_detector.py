"""SWIM-style failure detection: one probe a round, helpers before suspicion, suspicions checked."""

import random

from meshnode.mesh.failure_detector import CHECKS_PER_ROUND, RUMOR_SENDS, FailureDetector

SELF = b"\x00" * 32
PEERS = [bytes([i]) * 32 for i in range(1, 11)]


def detector(**kwargs) -> FailureDetector:
    return FailureDetector(SELF, rng=random.Random(3), **kwargs)


def test_every_member_is_probed_once_in_as_many_rounds_as_there_are_members():
    fd = detector()
    probed = [fd.start_round(set(PEERS)).probe for _ in PEERS]
    assert sorted(probed) == sorted(PEERS)


def test_helpers_exclude_the_target_and_us_and_number_k():
    fd = detector(indirect_probes=3)
    helpers = fd.helpers_for(PEERS[0], [SELF, *PEERS])
    assert len(helpers) == 3
    assert PEERS[0] not in helpers and SELF not in helpers


def test_a_suspect_not_heard_from_is_confirmed_after_the_suspicion_rounds():
    fd = detector(suspicion_rounds=2)
    members = set(PEERS)
    fd.start_round(members)
    fd.unreachable(PEERS[0])
    assert fd.start_round(members).confirmed == ()
    assert fd.start_round(members).confirmed == ()
    assert fd.start_round(members).confirmed == (PEERS[0],)
    assert PEERS[0] not in fd.suspects


def test_a_suspect_that_answers_is_alive_again():
    fd = detector(suspicion_rounds=1)
    fd.start_round(set(PEERS))
    fd.unreachable(PEERS[0])
    fd.alive(PEERS[0])
    for _ in range(3):
        assert fd.start_round(set(PEERS)).confirmed == ()
    assert fd.rumors() == []


def test_a_suspicion_rides_on_a_bounded_number_of_frames():
    fd = detector()
    fd.start_round(set(PEERS))
    fd.unreachable(PEERS[0])
    sends = 0
    while fd.rumors():
        sends += 1
    assert sends == RUMOR_SENDS


def test_suspicions_heard_are_checked_by_our_own_probes_a_few_a_round_never_believed():
    fd = detector()
    fd.heard([SELF, PEERS[1], *PEERS[2:]], sender=PEERS[1])  # never us, never the sender itself
    plan = fd.start_round(set(PEERS))
    assert len(plan.checks) == CHECKS_PER_ROUND
    assert SELF not in plan.checks and PEERS[1] not in plan.checks
    assert not fd.suspects  # heard, not believed
    later = fd.start_round(set(PEERS)).checks
    assert not set(plan.checks) & set(later)


def test_rumors_leave_room_for_what_the_frame_carries_besides_and_only_those_sent_count():
    fd = detector()
    fd.start_round(set(PEERS))
    fd.unreachable(PEERS[0])
    fd.unreachable(PEERS[1])
    assert fd.rumors(limit=1) == [PEERS[0]]
    assert fd.rumors(limit=0) == []
    sends = 1
    while PEERS[0] in fd.rumors():
        sends += 1
    assert sends == RUMOR_SENDS
