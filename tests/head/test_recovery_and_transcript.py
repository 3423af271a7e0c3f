"""Pure pieces of the driver: recovery decisions, replay plans and gossip candidates."""

from __future__ import annotations

import pytest

from meshnode.dataplane.errors import SessionTransportError, refusal
from meshnode.head.candidates import (
    identities_for_artifact,
    routable_models,
    session_fingerprint,
    shard_candidate,
    shard_candidates,
)
from meshnode.head.planner import ModelIdentity
from meshnode.head.recovery import Recovery, RecoveryBudget, RecoveryPolicy, describe
from meshnode.head.transcript import ReplayStep, Transcript
from meshnode.wire.pb import mesh, shard

CACHE_MISS = refusal(shard.ERROR_CODE_CACHE_MISS, "session cache is not positioned as expected")
GONE = SessionTransportError("the worker is unreachable")


def test_a_cache_miss_rebuilds_once_per_epoch_then_reroutes():
    policy = RecoveryPolicy()
    assert policy.decide(CACHE_MISS).recovery is Recovery.REBUILD
    second = policy.decide(CACHE_MISS)
    assert second.recovery is Recovery.REROUTE
    assert second.reason == "cache_miss: session cache is not positioned as expected"
    # The new epoch may rebuild again.
    assert policy.decide(CACHE_MISS).recovery is Recovery.REBUILD


def test_route_failures_reroute_until_the_budget_is_spent():
    policy = RecoveryPolicy(RecoveryBudget(reroutes=2))
    assert [policy.decide(GONE).recovery for _ in range(2)] == [Recovery.REROUTE] * 2
    final = policy.decide(refusal(shard.ERROR_CODE_INTERNAL, "next hop unreachable", retryable=True))
    assert final.recovery is Recovery.GIVE_UP
    assert final.reason == "the route failed 3 times; last failure: internal: next hop unreachable"


def test_a_reroute_with_every_hop_alive_waits_longer_each_time_up_to_the_cap():
    policy = RecoveryPolicy(RecoveryBudget(reroutes=6, settle_s=0.2, max_settle_s=1.0))
    delays = []
    for _ in range(5):
        assert policy.decide(GONE).recovery is Recovery.REROUTE
        delays.append(policy.settle_delay_s())
    assert delays == [0.2, 0.4, 0.8, 1.0, 1.0]


@pytest.mark.parametrize(
    "code",
    [
        shard.ERROR_CODE_DEADLINE_EXCEEDED,
        shard.ERROR_CODE_EPOCH_STALE,
        shard.ERROR_CODE_FINGERPRINT_MISMATCH,
        shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
        shard.ERROR_CODE_PAYLOAD_CORRUPT,
        shard.ERROR_CODE_CANCELLED,
    ],
)
def test_other_refusals_reroute(code):
    assert RecoveryPolicy().decide(refusal(code, "x")).recovery is Recovery.REROUTE


def test_a_request_beyond_the_context_gives_up_at_once_but_a_busy_worker_does_not():
    policy = RecoveryPolicy()
    too_long = refusal(shard.ERROR_CODE_RESOURCE_EXHAUSTED, "past the session's context", retryable=False)
    decision = policy.decide(too_long)
    assert decision.recovery is Recovery.GIVE_UP and decision.request_too_large
    assert "does not fit the model's context" in decision.reason
    busy = refusal(shard.ERROR_CODE_RESOURCE_EXHAUSTED, "too many sessions", retryable=True)
    assert policy.decide(busy).recovery is Recovery.REROUTE
    assert describe(GONE) == "the worker is unreachable"


def test_a_replay_repeats_the_original_units_at_their_positions():
    transcript = Transcript((10, 11, 12))
    assert transcript.replay_steps() == [] and not transcript.started
    for token in (20, 21, 22, 23):
        transcript.record(token)
    # The prompt's prefill produced 20; then 20, 21, 22 were fed at positions 3, 4, 5.
    assert transcript.replay_steps() == [ReplayStep(20, 3, 21), ReplayStep(21, 4, 22), ReplayStep(22, 5, 23)]
    assert transcript.next_input() == (23, 6)
    with pytest.raises(ValueError):
        Transcript(())


def announcement(
    node: int,
    start: int,
    end: int,
    *,
    recipe: str = "r1",
    state: shard.ServingState = shard.SERVING_STATE_UNSPECIFIED,
    numerics: str = "",
) -> mesh.PeerAnnouncement:
    a = mesh.PeerAnnouncement(endpoint_id=bytes([node]) * 32)
    a.serving.model_name = "m"
    a.serving.fingerprint.model_artifact_digest = "art"
    a.serving.fingerprint.runtime_recipe_digest = recipe
    a.serving.numerics = numerics
    a.serving.shard_range.start_layer = start
    a.serving.shard_range.end_layer = end
    a.serving.total_layers = 6
    a.capacity.max_concurrent_sessions = 4
    a.load.active_sessions = 1
    a.load.serving_state = state
    return a


def test_candidates_come_from_announcements_that_serve_something_routable():
    model = ModelIdentity("art", "r1", 6)
    idle = mesh.PeerAnnouncement(endpoint_id=b"\x09" * 32)
    no_digest = announcement(8, 0, 6)
    no_digest.serving.fingerprint.model_artifact_digest = ""
    bad_range = announcement(7, 4, 9)
    pairs = [(bytes([n]) * 32, a) for n, a in [(1, announcement(1, 0, 3)), (2, announcement(2, 3, 6))]]
    pairs += [(b"\x09" * 32, idle), (b"\x08" * 32, no_digest), (b"\x07" * 32, bad_range)]
    candidates = shard_candidates(pairs)
    assert [(c.start_layer, c.end_layer) for c in candidates] == [(0, 3), (3, 6)]
    assert candidates[0].model == model and candidates[0].load == 0.25
    assert routable_models(candidates) == {model: {"m"}}
    assert session_fingerprint(model) == shard.Fingerprint(
        model_artifact_digest="art", runtime_recipe_digest="r1"
    )


def test_draining_peers_and_other_recipes_stay_apart():
    draining = shard_candidate(b"\x03" * 32, announcement(3, 0, 6, state=shard.SERVING_STATE_DRAINING))
    assert draining is not None and not draining.accepting
    other = shard_candidate(b"\x04" * 32, announcement(4, 0, 6, recipe="r2"))
    head = shard_candidate(b"\x05" * 32, announcement(5, 0, 3))
    assert other is not None and head is not None
    assert identities_for_artifact([head, other], "art") == [head.model, other.model]
    # r1 covers only [0, 3); r2 covers everything.
    assert routable_models([head, other, draining]) == {other.model: {"m"}}


def test_peers_that_differ_only_in_numerics_serve_one_model_and_route_together():
    gpu = shard_candidate(b"\x01" * 32, announcement(1, 0, 3, numerics="llama-cpp-python 0.3.36; gpu"))
    cpu = shard_candidate(b"\x02" * 32, announcement(2, 3, 6, numerics="llama-cpp-python 0.3.36; cpu"))
    assert gpu is not None and cpu is not None
    assert gpu.model == cpu.model
    assert (gpu.numerics, cpu.numerics) == ("llama-cpp-python 0.3.36; gpu", "llama-cpp-python 0.3.36; cpu")
    assert identities_for_artifact([gpu, cpu], "art") == [gpu.model]
    assert routable_models([gpu, cpu]) == {gpu.model: {"m"}}
    # Another contract under the same numerics is still another model: no route mixes the two.
    other = shard_candidate(b"\x03" * 32, announcement(3, 3, 6, recipe="r2", numerics=cpu.numerics))
    assert other is not None and other.model != gpu.model
    assert routable_models([gpu, other]) == {}
