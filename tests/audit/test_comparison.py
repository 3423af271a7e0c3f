"""Comparing two runs hop by hop and judging a disputed unit (pure; signed commitments, no mesh)."""

from __future__ import annotations

from meshnode.audit.commitment import CommitmentSigner
from meshnode.audit.comparison import Statement, first_divergence, judge, statements
from meshnode.audit.evidence import check_evidence
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard

FINGERPRINT = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)
HEAD, LIAR, SPARE, THIRD, TAIL, OTHER_TAIL = (NodeIdentity.from_seed(bytes([i + 1]) * 32) for i in range(6))
HOPS = [(0, 2), (2, 3), (3, 4)]


def commitment(
    who: NodeIdentity,
    hop: tuple[int, int],
    step: int,
    input_digest: bytes,
    output: bytes,
    *,
    exact: bool = True,
) -> shard.SignedCommitment:
    signer = CommitmentSigner.for_engine(who, FINGERPRINT, exact=exact, numerics="cpu" if exact else "gpu")
    return signer.sign(
        shard_range=(hop[0], hop[1], hop[0]),
        session_id="s",
        epoch=1,
        step=step,
        work_id=f"w{step}",
        first_position=step,
        token_count=1,
        input_digest=input_digest,
        output=output,
    )


def digest(*parts: object) -> bytes:
    return repr(parts).encode().ljust(32, b".")[:32]


def run(middle: NodeIdentity, tail: NodeIdentity, *, wrong_at: int | None = None, exact: bool = True):
    """Three steps over HOPS; ``middle`` states a wrong output at step ``wrong_at``, and what
    follows it (the tail's input chain) differs from then on."""
    signed = []
    for step in (1, 2, 3):
        lied = wrong_at is not None and step >= wrong_at
        signed.append(commitment(HEAD, HOPS[0], step, digest("in0", step), digest("out0", step)))
        out1 = digest("wrong", step) if wrong_at == step else digest("out1", step)
        signed.append(commitment(middle, HOPS[1], step, digest("out0", step), out1, exact=exact))
        tail_input = digest("tail-in", step, "after-lie" if lied else "")
        signed.append(commitment(tail, HOPS[2], step, tail_input, digest("tok", tail_input)))
    return statements(signed)


def test_honest_runs_agree_on_every_unit():
    comparison = first_divergence(run(SPARE, TAIL), run(THIRD, OTHER_TAIL), HOPS)
    assert comparison.divergence is None and comparison.compared == 9


def test_the_first_hop_given_equal_inputs_with_other_outputs_is_the_divergence():
    comparison = first_divergence(run(LIAR, TAIL, wrong_at=2), run(SPARE, TAIL), HOPS)
    divergence = comparison.divergence
    assert divergence is not None and divergence.key == ((2, 3), 2)
    assert (divergence.original.signer, divergence.replay.signer) == (LIAR.node_id, SPARE.node_id)
    # Step 1 whole, then step 2's first hop, then the dispute: the tail's differing input is not
    # compared (its input differs because of the lie upstream).
    assert comparison.compared == 5


def test_a_difference_at_an_inexact_hop_is_only_checked_within_tolerance():
    comparison = first_divergence(run(LIAR, TAIL, wrong_at=2, exact=False), run(SPARE, TAIL), HOPS)
    assert comparison.divergence is None and comparison.within_tolerance == 1


def test_malformed_commitments_are_left_out_and_forged_ones_are_never_judged_on():
    malformed = shard.SignedCommitment(commitment=b"\xff\xff")
    assert statements([malformed]).unopened == 1 and not statements([malformed]).by_key
    # Unsigned (or forged): compared cheaply, but a checked run leaves it out, and so does the judge.
    unsigned = shard.SignedCommitment(
        commitment=commitment(SPARE, HOPS[1], 2, b"i" * 32, b"y" * 32).commitment
    )
    assert statements([unsigned]).by_key and statements([unsigned], verify=True).unopened == 1
    liar = opened(commitment(LIAR, HOPS[1], 2, b"i" * 32, b"x" * 32))
    third = opened(commitment(THIRD, HOPS[1], 2, b"i" * 32, b"y" * 32))
    (forged_witness,) = statements([unsigned]).by_key.values()
    assert judge([liar, forged_witness, third]) is None


def opened(signed: shard.SignedCommitment) -> Statement:
    (statement,) = statements([signed]).by_key.values()
    return statement


def test_two_replicas_against_one_convict_it_and_one_against_one_does_not():
    liar = opened(commitment(LIAR, HOPS[1], 2, b"i" * 32, b"x" * 32))
    spare = opened(commitment(SPARE, HOPS[1], 2, b"i" * 32, b"y" * 32))
    third = opened(commitment(THIRD, HOPS[1], 2, b"i" * 32, b"y" * 32))
    assert judge([liar, spare]) is None
    # A third statement for another input is left out: it decides nothing.
    elsewhere = opened(commitment(THIRD, HOPS[1], 2, b"j" * 32, b"y" * 32))
    assert judge([liar, spare, elsewhere]) is None
    conviction = judge([liar, spare, third], reporter_id=HEAD.node_id)
    assert conviction is not None and conviction.accused == LIAR.node_id
    assert check_evidence(conviction.evidence).convicted
    assert conviction.evidence.reporter_id == HEAD.node_id


def test_a_node_contradicting_itself_needs_two_other_witnesses():
    first = opened(commitment(LIAR, HOPS[1], 2, b"i" * 32, b"x" * 32))
    again = opened(commitment(LIAR, HOPS[1], 2, b"i" * 32, b"y" * 32))
    spare = opened(commitment(SPARE, HOPS[1], 2, b"i" * 32, b"y" * 32))
    # The liar's own second statement is no witness against its first.
    assert judge([first, again, spare]) is None
    third = opened(commitment(THIRD, HOPS[1], 2, b"i" * 32, b"y" * 32))
    conviction = judge([first, again, spare, third])
    assert conviction is not None and conviction.accused == LIAR.node_id
