"""The admission policy alone (pure): what a worker refuses a new session and a unit, and why."""

from __future__ import annotations

from meshnode.dataplane.admission import AdmissionPolicy
from meshnode.wire.pb import shard

POLICY = AdmissionPolicy(
    max_sessions=4,
    peer_session_cap=3,
    max_context_tokens=512,
    max_total_context_tokens=1000,
    max_queue_depth=8,
)
SERVING = shard.SERVING_STATE_SERVING


def test_a_session_is_admitted_while_serving_with_room_and_within_the_peers_share():
    assert POLICY.refuse_session(serving_state=SERVING, sessions=3, peer_sessions=2) is None
    assert POLICY.refuse_session(serving_state=SERVING, sessions=3, peer_sessions=None) is None


def test_a_session_is_refused_when_draining_full_or_over_the_peers_share():
    draining = POLICY.refuse_session(serving_state=shard.SERVING_STATE_DRAINING, sessions=0, peer_sessions=0)
    assert draining is not None and draining.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert draining.error.detail == "worker is not accepting new sessions (draining)" and not draining.share
    full = POLICY.refuse_session(serving_state=SERVING, sessions=4, peer_sessions=None)
    assert full is not None and full.error.detail == "worker already serves 4 sessions" and not full.share
    share = POLICY.refuse_session(serving_state=SERVING, sessions=3, peer_sessions=3)
    assert share is not None and share.share and share.error.retryable
    assert share.error.detail == "this peer already holds 3 of the worker's 4 sessions, its share"


def test_a_unit_past_the_context_the_budget_or_the_queue_is_refused_and_only_the_first_for_good():
    assert POLICY.refuse_unit(position_end=512, session_tokens=512, tokens_in_use=488, queued=7) is None
    past = POLICY.refuse_unit(position_end=513, session_tokens=513, tokens_in_use=0, queued=0)
    assert past is not None and not past.retryable
    assert past.detail == "position 513 is past the 512-token context of a session"
    budget = POLICY.refuse_unit(position_end=100, session_tokens=100, tokens_in_use=901, queued=0)
    assert (
        budget is not None
        and budget.retryable
        and budget.detail == "worker context budget of 1000 tokens is in use"
    )
    queue = POLICY.refuse_unit(position_end=1, session_tokens=1, tokens_in_use=0, queued=8)
    assert queue is not None and queue.detail == "worker queue holds 8 units"
    unlimited = AdmissionPolicy(4, 3, 512, None, 8)
    assert unlimited.refuse_unit(position_end=10, session_tokens=10, tokens_in_use=10**9, queued=0) is None
