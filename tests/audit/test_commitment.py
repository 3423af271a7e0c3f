"""Unit commitments: the digests they state, their signatures, and what opening one refuses."""

from __future__ import annotations

import numpy as np
import pytest

from engines.interface import GREEDY, SamplingParams, SessionKey, StepRequest, StepResult
from meshnode.audit.commitment import (
    COMMITMENT_DOMAIN,
    MAX_COMMITMENT_BYTES,
    CommitmentRejected,
    CommitmentSigner,
    chained_input_digest,
    open_commitment,
    output_digest,
    recipe_digest,
    sign_commitment,
)
from meshnode.identity import NodeIdentity
from meshnode.mesh.signed_record import RECORD_DOMAIN
from meshnode.wire.pb import shard

ALICE = NodeIdentity.from_seed(b"a" * 32)
BOB = NodeIdentity.from_seed(b"b" * 32)
FINGERPRINT = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)


def hidden_request(hidden: np.ndarray, *, first: int = 0, session: str = "s") -> StepRequest:
    return StepRequest(
        session=SessionKey(session, 1),
        first_position=first,
        hidden=hidden,
        expected_past_len=first if first else None,
    )


def signer(identity: NodeIdentity = ALICE, *, exact: bool = True) -> CommitmentSigner:
    return CommitmentSigner.for_engine(identity, FINGERPRINT, exact=exact, numerics="numpy float32; cpu")


def signed(identity: NodeIdentity = ALICE, *, output: bytes = b"o" * 32, exact: bool = True):
    return signer(identity, exact=exact).sign(
        shard_range=(0, 4, 2),
        session_id="s",
        epoch=1,
        step=3,
        work_id="w",
        first_position=7,
        token_count=1,
        input_digest=b"i" * 32,
        output=output,
    )


def test_a_signed_commitment_opens_to_what_its_signer_stated():
    commitment = open_commitment(signed())
    assert bytes(commitment.node_id) == ALICE.node_id
    assert (commitment.shard_range.start_layer, commitment.shard_range.end_layer) == (0, 4)
    assert commitment.shard_range.effective_start_layer == 2
    assert commitment.numerics == shard.NUMERICS_EXACT
    assert commitment.recipe_digest == recipe_digest(FINGERPRINT)
    assert (commitment.idempotency_step, commitment.position.first_position) == (3, 7)
    assert open_commitment(signed(exact=False)).numerics == shard.NUMERICS_INEXACT


def test_a_changed_byte_or_another_signer_is_refused():
    good = signed()
    tampered = shard.SignedCommitment(
        commitment=good.commitment.replace(b"o" * 32, b"p" * 32), signature=good.signature
    )
    with pytest.raises(CommitmentRejected, match="not signed by the node it names"):
        open_commitment(tampered)
    # Bob's signature over Alice's statement is not Alice's.
    forged = shard.SignedCommitment(
        commitment=good.commitment, signature=BOB.sign(COMMITMENT_DOMAIN + good.commitment)
    )
    with pytest.raises(CommitmentRejected, match="not signed by the node it names"):
        open_commitment(forged)
    with pytest.raises(ValueError, match="only its own"):
        sign_commitment(BOB, shard.UnitCommitment.FromString(good.commitment))


def test_a_node_key_signature_made_for_a_peer_record_is_not_a_commitment():
    body = signed().commitment
    record_signature = ALICE.sign(RECORD_DOMAIN + body)
    with pytest.raises(CommitmentRejected):
        open_commitment(shard.SignedCommitment(commitment=body, signature=record_signature))


def test_malformed_commitments_are_refused_before_any_signature_check():
    with pytest.raises(CommitmentRejected, match="does not decode"):
        open_commitment(shard.SignedCommitment(commitment=b"\xff\xff", signature=b"x" * 64))
    short = shard.UnitCommitment(node_id=ALICE.node_id, input_digest=b"i", output_digest=b"o" * 32)
    with pytest.raises(CommitmentRejected, match="digests are not 32 bytes"):
        open_commitment(shard.SignedCommitment(commitment=short.SerializeToString(), signature=b"x" * 64))
    with pytest.raises(CommitmentRejected, match="at most"):
        open_commitment(shard.SignedCommitment(commitment=b"\0" * (MAX_COMMITMENT_BYTES + 1)))


def test_the_input_digest_chains_the_history_and_ignores_the_sessions_name():
    rng = np.random.default_rng(1)
    first, second = rng.standard_normal((2, 1, 8), dtype=np.float32)
    start = chained_input_digest(None, hidden_request(first))
    # The same step under another session's name: the same digest (a replay runs under another).
    assert chained_input_digest(None, hidden_request(first, session="replay")) == start
    after = chained_input_digest(start, hidden_request(second, first=1))
    other_history = chained_input_digest(
        chained_input_digest(None, hidden_request(second)), hidden_request(second, first=1)
    )
    assert after != other_history
    # Sampling is part of what a tail was asked.
    tokens = StepRequest(session=SessionKey("s", 1), first_position=0, token_ids=(1, 2), sampling=GREEDY)
    seeded = StepRequest(
        session=SessionKey("s", 1), first_position=0, token_ids=(1, 2), sampling=SamplingParams(seed=4)
    )
    assert chained_input_digest(None, tokens) != chained_input_digest(None, seeded)


def test_the_output_digest_tells_one_unit_in_the_last_place():
    hidden = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    nudged = hidden.copy()
    nudged[1, 3] = np.nextafter(nudged[1, 3], np.float32(np.inf))
    assert output_digest(StepResult(2, False, hidden=hidden)) == output_digest(
        StepResult(2, False, hidden=hidden.copy())
    )
    assert output_digest(StepResult(2, False, hidden=hidden)) != output_digest(
        StepResult(2, False, hidden=nudged)
    )
    assert output_digest(StepResult(1, False, token_id=3)) != output_digest(StepResult(1, False, token_id=4))
