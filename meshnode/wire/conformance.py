"""Canonical conformance messages, committed as golden bytes under ``tests/vectors/``.

A peer in any language proves it speaks the schema by parsing these bytes,
checking every field and re-serialising to the same bytes. Regenerate with
``python scripts/generate_vectors.py`` (``--check`` fails on drift).
"""

from __future__ import annotations

import numpy as np

from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle, encode_tensor

SESSION_ID = "rs-00000000-golden"
HIDDEN_SHAPE = (4, 64)
FRAGMENT_BYTES = 256


def golden_hidden_states() -> np.ndarray:
    """Deterministic float32 activations: exact binary fractions, no RNG involved."""
    count = HIDDEN_SHAPE[0] * HIDDEN_SHAPE[1]
    return ((np.arange(count, dtype=np.float32) - 128.0) / 64.0).reshape(HIDDEN_SHAPE)


def golden_session_request() -> shard.SessionRequest:
    hidden = encode_tensor(
        "hidden_states", shard.DTYPE_FLOAT32, golden_hidden_states(), max_fragment_bytes=FRAGMENT_BYTES
    )
    positions = encode_tensor("position_ids", shard.DTYPE_INT32, np.arange(4, 8, dtype=np.int32))
    envelope = shard.Envelope(
        schema_version=shard.SCHEMA_VERSION_1,
        work_id="work-0001",
        route_session_id=SESSION_ID,
        route_epoch=3,
        fingerprint=shard.Fingerprint(
            model_artifact_digest="sha256:" + "ab" * 32,
            runtime_recipe_digest="sha256:" + "cd" * 32,
            recipe_id="meshnode-llama-layer-range",
            recipe_version="1",
            catalogue_version="golden",
        ),
        shard_range=shard.ShardRange(start_layer=6, end_layer=12, effective_start_layer=6),
        phase=shard.PHASE_PREFILL,
        position=shard.PositionSpan(first_position=4, token_count=4),
        idempotency_step=2,
        cache_expectation=shard.CacheExpectation(mode=shard.CACHE_MODE_DECODE, expected_past_len=4),
        deadline_unix_nanos=1_900_000_000_000_000_000,
        chunk=shard.ChunkInfo(chunk_index=1, chunk_count=2, final_chunk=True),
    )
    return shard.SessionRequest(
        chunk=shard.ActivationChunk(envelope=envelope, bundle=encode_bundle([hidden, positions]))
    )


def golden_vectors() -> dict[str, bytes]:
    """File name under tests/vectors/ -> canonical bytes."""
    return {"session_request_golden.binpb": golden_session_request().SerializeToString(deterministic=True)}
