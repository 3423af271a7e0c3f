"""A worker given the node key signs a commitment for every unit it applies (sans-IO, fake engine)."""

from __future__ import annotations

import numpy as np
from helpers.recording_engine import RecordingEngine

from engines.interface import EngineError, EngineErrorKind, SessionKey, StepRequest
from meshnode.audit.commitment import chained_input_digest, open_commitment, output_digest
from meshnode.dataplane.actions import DownstreamResult, Forward
from meshnode.dataplane.route import make_hop, make_route
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard

from .harness import (
    NODE_B,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    only_status,
    responses,
    srange,
)

KEY = NodeIdentity.from_seed(b"k" * 32)
PROMPT = [1, 2, 3]


def tail_harness() -> tuple[WorkerHarness, int]:
    harness = WorkerHarness(RecordingEngine(2, 4), identity=KEY)
    stream, _ = harness.open(shard_range=srange(2, 4))
    return harness, stream


def test_a_tails_ack_carries_its_signed_commitment_to_the_units_digests():
    harness, stream = tail_harness()
    hidden = np.linspace(-1, 1, 3 * 8, dtype=np.float32).reshape(3, 8)
    (ack,) = acks(harness.ask(stream, chunk_request(1, hidden, shard_range=srange(2, 4))))
    (signed,) = ack.commitments
    commitment = open_commitment(signed)
    assert bytes(commitment.node_id) == KEY.node_id
    assert (commitment.idempotency_step, commitment.work_id, commitment.route_session_id) == (1, "w1", "s1")
    assert commitment.numerics == shard.NUMERICS_EXACT
    # The digests are those of what the engine was asked and answered, recomputed here.
    engine = RecordingEngine(2, 4)
    request = StepRequest(
        session=SessionKey("x", 1),
        first_position=0,
        hidden=hidden,
        sampling=harness.engine.calls[0].sampling,
        sample_index=3,
        effective_start_layer=2,
    )
    assert commitment.input_digest == chained_input_digest(None, request)
    assert commitment.output_digest == output_digest(engine.prefill(request))


def test_after_an_engine_failure_no_commitment_until_a_fresh_start():
    harness, stream = tail_harness()
    hidden = np.ones((3, 8), dtype=np.float32)
    harness.ask(stream, chunk_request(1, hidden, shard_range=srange(2, 4)))
    harness.engine.fail_next = EngineError(EngineErrorKind.INTERNAL, "lost")
    status = only_status(harness.ask(stream, decode_request(2, np.ones(8, dtype=np.float32), 3)))
    assert status.error.code == shard.ERROR_CODE_INTERNAL
    # The session goes on, but what the engine held across the failure is not known: unsigned.
    (ack,) = acks(harness.ask(stream, decode_request(3, np.ones(8, dtype=np.float32), 3)))
    assert ack.cache_result.past_len == 4 and not ack.commitments
    (fresh,) = acks(harness.ask(stream, chunk_request(4, hidden, shard_range=srange(2, 4))))
    assert len(fresh.commitments) == 1


def test_a_middle_hop_passes_on_at_most_one_commitment_per_later_hop_and_replays_them():
    harness = WorkerHarness(RecordingEngine(0, 2), identity=KEY)
    stream, _ = harness.open(make_route([make_hop(NODE_B, 2, 4, 2)]), shard_range=srange(0, 2))
    actions = harness.send(stream, chunk_request(1, PROMPT, shard_range=srange(0, 2)))
    (forward,) = [a for a in actions if isinstance(a, Forward)]
    later = tuple(shard.SignedCommitment(commitment=bytes([i]), signature=b"s") for i in range(3))
    answered = harness.run(
        harness.downstream_finished(forward.unit_id, DownstreamResult(commitments=later), harness.now)
    )
    (ack,) = acks(responses(answered, stream))
    own, passed = ack.commitments
    assert bytes(open_commitment(own).node_id) == KEY.node_id
    # One hop after this one: one of what it sent back goes on, the rest are dropped.
    assert passed == later[0]
    # A retry of the step is answered from the record, with the same commitments.
    (again,) = acks(harness.ask(stream, chunk_request(1, PROMPT, shard_range=srange(0, 2))))
    assert again.duplicate and list(again.commitments) == [own, passed]


def test_a_worker_without_a_key_signs_nothing():
    harness = WorkerHarness(RecordingEngine(2, 4))
    stream, _ = harness.open(shard_range=srange(2, 4))
    (ack,) = acks(
        harness.ask(stream, chunk_request(1, np.ones((2, 8), dtype=np.float32), shard_range=srange(2, 4)))
    )
    assert not ack.commitments
