"""Signed unit commitments: what one hop says it computed for one unit. Pure and synchronous.

Within one recipe a layer range computed with exact numerics gives the same bytes on any node,
alone or batched (engines.row_invariance). So if every hop states, signed with its node key, a
digest of what it was given and a digest of what it gave back, two replicas of a range that
state the same input and different outputs convict one of them, and the statements themselves
are the proof (:mod:`meshnode.audit.evidence`).

What "the same input" means: a unit's output depends on the session's whole history on that
hop (its KV cache), so the input digest is a chain: SHA-256 over the previous unit's input
digest and this unit's own material (positions, cache expectation, sampling, the tensor or
tokens). It restarts at every fresh start (a prefill from position 0). Equal chains mean equal
histories, which is what makes a differing output a lie rather than a different question.

The signature covers ``COMMITMENT_DOMAIN || bytes``, the bytes as the signer serialized them;
like signed peer records (:mod:`meshnode.mesh.signed_record`) they travel unchanged and are
never re-encoded. The domain differs from every other use of a node key (peer records, relay
registration and seal, certificates), so no other signature verifies as a commitment.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from engines.interface import SamplingParams, StepRequest, StepResult
from meshnode.identity import NODE_ID_BYTES, NodeIdentity, verify_signature
from meshnode.wire.pb import shard

COMMITMENT_DOMAIN = b"meshnode/v1/unit-commitment\0"
DIGEST_BYTES = 32
# A commitment is a few hundred bytes, the previous hop's handoff inside it included (about 500
# in all); anything much larger is not one (never parsed further).
MAX_COMMITMENT_BYTES = 2048
_CHAIN_START = b"meshnode/v1/audit-chain\0"


class CommitmentRejected(Exception):
    """A signed commitment that does not decode, is malformed, or is not signed by the node it names."""


def _digest(*parts: bytes | memoryview) -> bytes:
    # SHA-256: with the CPU's SHA extensions 2.4x BLAKE2b's speed here (8 MiB of a long prefill
    # chunk's hidden states in 7 ms against 17), and a unit's digests are on the event loop.
    hasher = hashlib.sha256()
    for part in parts:
        # Length-prefixed, so no two sequences of parts hash alike.
        hasher.update(struct.pack("<Q", part.nbytes if isinstance(part, memoryview) else len(part)))
        hasher.update(part)
    return hasher.digest()


def recipe_digest(fingerprint: shard.Fingerprint) -> bytes:
    """The recipe a commitment is made under: the two digests identity compares, not the labels."""
    material = f"{fingerprint.model_artifact_digest}\0{fingerprint.runtime_recipe_digest}".encode()
    return hashlib.sha256(material).digest()


def _array_parts(array: np.ndarray) -> tuple[bytes, memoryview]:
    """Its shape, and its float32 little-endian bytes: a view, never a copy, when it is already so."""
    canonical = np.ascontiguousarray(array, dtype="<f4")
    return struct.pack(f"<{canonical.ndim}q", *canonical.shape), canonical.data.cast("B")


def _sampling_material(sampling: SamplingParams | None) -> bytes:
    if sampling is None:
        return b""
    # repr of a frozen dataclass of numbers, tuples and strings: stable for one meshnode version,
    # and replicas audited against each other run one (their recipes agree).
    return repr(sampling).encode()


def step_material(request: StepRequest) -> bytes:
    """What one engine step was asked, in canonical bytes (the session's name left out: a replay
    on a replica runs under another)."""
    header = struct.pack(
        "<qiqqii?i?",
        request.first_position,
        request.n_tokens,
        -1 if request.expected_past_len is None else request.expected_past_len,
        -1 if request.effective_start_layer is None else request.effective_start_layer,
        request.sample_index,
        request.draft_tokens,
        request.rollback,
        len(request.prefix_digest),
        request.want_logits,
    )
    body: tuple[bytes | memoryview, ...]
    if request.token_ids is not None:
        body = (b"T", np.asarray(request.token_ids, dtype="<i4").tobytes())
    else:
        assert request.hidden is not None
        body = (b"H", *_array_parts(request.hidden))
    # The block digest is left out: it names a prefix for the receiver to keep and changes nothing
    # computed (a replay sends none, so as not to fill replicas' prefix caches).
    return _digest(header, request.prefix_digest, _sampling_material(request.sampling), *body)


def chained_input_digest(previous: bytes | None, request: StepRequest) -> bytes:
    """The input digest of ``request``: chained onto ``previous`` (the session's last applied unit's
    input digest), or starting a chain (``previous`` None: a fresh start)."""
    return _digest(_CHAIN_START if previous is None else previous, step_material(request))


def hidden_digest(hidden: np.ndarray) -> bytes:
    """The digest of hidden states alone: a forwarding hop's output digest, and the form in which
    a hop states what it sent (:mod:`meshnode.audit.handoff`), so the two compare as they are."""
    return _digest(b"H", *_array_parts(hidden))


def output_digest(result: StepResult) -> bytes:
    """What a hop computed: the hidden states it passes on, or the tail's tokens (and logits)."""
    parts: list[bytes | memoryview] = []
    if result.hidden is not None:
        parts += [b"H", *_array_parts(result.hidden)]
    if result.token_ids is not None:
        parts += [b"V", np.asarray(result.token_ids, dtype="<i4").tobytes()]
    elif result.token_id is not None:
        parts += [b"T", struct.pack("<i", result.token_id)]
    if result.logits is not None:
        parts += [b"L", *_array_parts(result.logits)]
    return _digest(*parts)


def make_commitment(
    *,
    node_id: bytes,
    shard_range: tuple[int, int, int],
    recipe: bytes,
    exact: bool,
    numerics_detail: str,
    session_id: str,
    epoch: int,
    step: int,
    work_id: str,
    first_position: int,
    token_count: int,
    input_digest: bytes,
    output: bytes,
    input_handoff: shard.SignedHandoff | None = None,
) -> shard.UnitCommitment:
    commitment = shard.UnitCommitment(
        node_id=node_id,
        route_session_id=session_id,
        route_epoch=epoch,
        idempotency_step=step,
        work_id=work_id,
        recipe_digest=recipe,
        numerics=shard.NUMERICS_EXACT if exact else shard.NUMERICS_INEXACT,
        numerics_detail=numerics_detail,
        input_digest=input_digest,
        output_digest=output,
    )
    commitment.position.first_position = first_position
    commitment.position.token_count = token_count
    start, end, effective = shard_range
    commitment.shard_range.start_layer = start
    commitment.shard_range.end_layer = end
    commitment.shard_range.effective_start_layer = effective
    if input_handoff is not None:
        commitment.input_handoff.CopyFrom(input_handoff)
    return commitment


def sign_commitment(identity: NodeIdentity, commitment: shard.UnitCommitment) -> shard.SignedCommitment:
    if bytes(commitment.node_id) != identity.node_id:
        raise ValueError("a node signs only its own commitments")
    body = commitment.SerializeToString(deterministic=True)
    return shard.SignedCommitment(commitment=body, signature=identity.sign(COMMITMENT_DOMAIN + body))


@dataclass(frozen=True)
class CommitmentSigner:
    """A hop's key and what it states about itself in every commitment: recipe and numerics."""

    identity: NodeIdentity
    recipe: bytes
    exact: bool
    numerics_detail: str

    @classmethod
    def for_engine(
        cls, identity: NodeIdentity, fingerprint: shard.Fingerprint, *, exact: bool, numerics: str
    ) -> CommitmentSigner:
        return cls(identity, recipe_digest(fingerprint), exact, numerics)

    def sign(
        self,
        *,
        shard_range: tuple[int, int, int],
        session_id: str,
        epoch: int,
        step: int,
        work_id: str,
        first_position: int,
        token_count: int,
        input_digest: bytes,
        output: bytes,
        input_handoff: shard.SignedHandoff | None = None,
    ) -> shard.SignedCommitment:
        commitment = make_commitment(
            node_id=self.identity.node_id,
            shard_range=shard_range,
            recipe=self.recipe,
            exact=self.exact,
            numerics_detail=self.numerics_detail,
            session_id=session_id,
            epoch=epoch,
            step=step,
            work_id=work_id,
            first_position=first_position,
            token_count=token_count,
            input_digest=input_digest,
            output=output,
            input_handoff=input_handoff,
        )
        return sign_commitment(self.identity, commitment)


def open_commitment(signed: shard.SignedCommitment) -> shard.UnitCommitment:
    """The commitment in ``signed``, once its form and its signer's signature check out."""
    commitment = decode_commitment(signed)
    if not signed_by_its_node(signed, commitment):
        raise CommitmentRejected("the commitment is not signed by the node it names")
    return commitment


def signed_by_its_node(signed: shard.SignedCommitment, commitment: shard.UnitCommitment) -> bool:
    return verify_signature(
        bytes(commitment.node_id), bytes(signed.signature), COMMITMENT_DOMAIN + bytes(signed.commitment)
    )


def decode_commitment(signed: shard.SignedCommitment) -> shard.UnitCommitment:
    """The commitment in ``signed`` once its form checks out, its signature NOT checked: for
    finding where two runs differ cheaply; only :func:`open_commitment` makes it a statement."""
    body = bytes(signed.commitment)
    if len(body) > MAX_COMMITMENT_BYTES:
        raise CommitmentRejected(f"a commitment of {len(body)} bytes (at most {MAX_COMMITMENT_BYTES})")
    try:
        commitment = shard.UnitCommitment.FromString(body)
    except DecodeError:
        raise CommitmentRejected("the commitment does not decode") from None
    if len(commitment.node_id) != NODE_ID_BYTES:
        raise CommitmentRejected("the commitment's node_id is not a node id")
    if len(commitment.input_digest) != DIGEST_BYTES or len(commitment.output_digest) != DIGEST_BYTES:
        raise CommitmentRejected(f"the commitment's digests are not {DIGEST_BYTES} bytes")
    return commitment


def is_exact(commitment: shard.UnitCommitment) -> bool:
    return commitment.numerics == shard.NUMERICS_EXACT


def layers(commitment: shard.UnitCommitment) -> tuple[int, int]:
    """The layers the hop ran, ``[effective_start_layer, end_layer)``."""
    return commitment.shard_range.effective_start_layer, commitment.shard_range.end_layer


__all__ = [
    "COMMITMENT_DOMAIN",
    "DIGEST_BYTES",
    "MAX_COMMITMENT_BYTES",
    "CommitmentRejected",
    "CommitmentSigner",
    "chained_input_digest",
    "decode_commitment",
    "hidden_digest",
    "is_exact",
    "layers",
    "make_commitment",
    "open_commitment",
    "output_digest",
    "recipe_digest",
    "sign_commitment",
    "signed_by_its_node",
    "step_material",
]
