"""A session sender's units: their state on the way to an answer, and how a prefill is cut into them.

Plain records owned by :class:`~meshnode.dataplane.client.SessionClient`, and the pure rule
that splits a prefill's inputs into chunks within the negotiated limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from meshnode.dataplane.envelope import Deadline, UnitPosition
from meshnode.wire.chunking import plan_prefill_chunks
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import NUMPY_DTYPES


class UnitState(Enum):
    PENDING = "pending"
    SENT = "sent"
    # Failed locally (deadline) while the peer still owes an answer that returns its credit.
    ABANDONED = "abandoned"
    # Done: its result came on the answer stream; the Ack that returns its credit is still owed.
    ANSWERED = "answered"


@dataclass(eq=False)
class OutgoingUnit:
    id: int
    step: int
    work_id: str
    position: UnitPosition
    deadline: Deadline | None
    tokens: np.ndarray | None
    hidden: np.ndarray | None
    # The forwarding hop's signed statement of ``hidden`` (meshnode.audit.handoff), sent with it.
    handoff: shard.SignedHandoff | None = None
    state: UnitState = UnitState.PENDING
    body: bytes | None = None
    attempts: int = 0
    # When it was last sent (monotonic); the answer grace counts from here too.
    sent_ns: int = 0
    result: shard.TensorBundle | None = None

    def given_up_at(self, grace_ns: int) -> int:
        """When the sender stops waiting for its answer: its deadline, plus the grace counted from
        the later of the deadline and its sending."""
        assert self.deadline is not None
        at_ns = self.deadline.at_ns
        return max(at_ns, self.sent_ns) + grace_ns if grace_ns else at_ns


@dataclass(frozen=True)
class PrefixBlocks:
    """Prefix cache, for a prefill from the head: its chunks fall on a grid of ``grid`` positions,
    each chunk that is one whole block carries the digest of every token up to its end
    (``digests[i]`` names positions ``[0, (i + 1) * grid)``), and a prefill starting past 0 asks
    each hop to open its session from the kept prefix named ``digests[first_position // grid - 1]``.

    With ``min_partial_rows`` (a route whose hops round a prefill row alike in any pass that large,
    engines.row_invariance) a chunk of at least that many rows that is not a whole block carries
    the digest at its end too, from ``digests`` on the grid and from ``partial_ends`` off it, and a
    prefill may start from a prefix named in ``partial_ends``."""

    grid: int
    digests: Sequence[bytes]
    # Prefix length -> digest for the prefixes ending off the grid that this prefill names.
    partial_ends: Mapping[int, bytes] = field(default_factory=dict)
    # 0: only whole blocks carry digests.
    min_partial_rows: int = 0

    def block_digest(self, first_position: int, token_count: int) -> bytes:
        end = first_position + token_count
        whole = token_count == self.grid and not first_position % self.grid
        if not whole and not (self.min_partial_rows and token_count >= self.min_partial_rows):
            return b""
        if end % self.grid:
            return self.partial_ends.get(end, b"")
        index = end // self.grid - 1
        return self.digests[index] if index < len(self.digests) else b""

    def start_digest(self, first_position: int) -> bytes:
        if first_position % self.grid:
            digest = self.partial_ends.get(first_position)
            if digest is None:
                raise ValueError(f"no kept prefix ends at position {first_position}")
            return digest
        index = first_position // self.grid - 1
        if not 0 <= index < len(self.digests):
            raise ValueError(f"no whole-block prefix ends at position {first_position}")
        return self.digests[index]


@dataclass(frozen=True)
class PrefillPiece:
    position: UnitPosition
    tokens: np.ndarray | None
    hidden: np.ndarray | None


def prefill_pieces(
    inputs: np.ndarray | Sequence[int],
    *,
    first_position: int,
    takes_tokens: bool,
    boundary_dtype: int,
    flow: shard.FlowControl,
    blocks: PrefixBlocks | None = None,
) -> list[PrefillPiece]:
    """Split a prefill's ``inputs`` (token ids ``[n]`` for a head hop, float32 hidden
    ``[n, hidden]`` otherwise) into chunks within ``flow``'s limits, on ``blocks``' grid when
    given (its first chunk then starts from the kept prefix before ``first_position``, if any)."""
    if takes_tokens:
        tokens = np.asarray(inputs, dtype=np.int32).reshape(-1)
        n, bytes_per_token = len(tokens), 4
        hidden = None
    else:
        hidden = np.asarray(inputs, dtype=np.float32)
        if hidden.ndim != 2:
            raise ValueError("hidden input must be [n, hidden]")
        n = hidden.shape[0]
        bytes_per_token = hidden.shape[1] * NUMPY_DTYPES[boundary_dtype].itemsize
        tokens = None
    chunks = plan_prefill_chunks(
        n,
        first_position=first_position,
        max_prefill_chunk_tokens=flow.max_prefill_chunk_tokens,
        bytes_per_token=bytes_per_token,
        max_chunk_bytes=flow.max_chunk_bytes,
        grid=None if blocks is None else blocks.grid,
        min_rows=0 if blocks is None else blocks.min_partial_rows,
    )
    prefix_digest = b""
    if blocks is not None and first_position:
        prefix_digest = blocks.start_digest(first_position)
    pieces = []
    for chunk in chunks:
        lo = chunk.first_position - first_position
        hi = lo + chunk.token_count
        position = UnitPosition(
            decode=False,
            first_position=chunk.first_position,
            token_count=chunk.token_count,
            expected_past_len=None if chunk.first_position == 0 else chunk.first_position,
            chunk_index=chunk.index,
            chunk_count=chunk.count,
            block_digest=b""
            if blocks is None
            else blocks.block_digest(chunk.first_position, chunk.token_count),
            prefix_digest=prefix_digest if chunk.index == 0 else b"",
        )
        pieces.append(
            PrefillPiece(
                position, None if tokens is None else tokens[lo:hi], None if hidden is None else hidden[lo:hi]
            )
        )
    return pieces


__all__ = ["OutgoingUnit", "PrefillPiece", "PrefixBlocks", "UnitState", "prefill_pieces"]
