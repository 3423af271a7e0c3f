"""What tensors cross one hop: inputs checked for this hop's role, results checked and encoded.

Names and shapes (SessionRoute's contract):

- head input: ``token_ids`` INT32 ``[n]``;
- activations: ``hidden_states`` ``[n, hidden]`` in the route's boundary dtype;
- tail result: ``token_ids`` INT32 ``[1]`` (the sampled token), plus ``logits``
  FLOAT32 ``[vocab]`` only when the route asks for them; for a verify step of
  speculative decoding, ``token_ids`` INT32 ``[1 + drafts]``: the choice after every
  position.

Decoding itself (fragments, checksum, zstd bounds) is ``meshnode.wire.tensor_codec``;
this module only adds what the role implies.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import cast

import numpy as np

from engines.interface import StepResult
from meshnode.dataplane.errors import MALFORMED_RESULT_DETAIL, payload_corrupt, refusal
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import (
    WireTensor,
    decode_bundle_parts,
    decode_tensor,
    encode_bundle,
    encode_float_tensor,
    encode_tensor,
)
from meshnode.wire.tensor_parts import BundleParts, TensorParts

TOKEN_IDS = "token_ids"
HIDDEN_STATES = "hidden_states"
LOGITS = "logits"


@dataclass(frozen=True)
class HopRole:
    """What one worker takes and returns on one route."""

    takes_tokens: bool
    is_tail: bool
    hidden_size: int
    vocab_size: int
    boundary_dtype: int

    @property
    def input_name(self) -> str:
        return TOKEN_IDS if self.takes_tokens else HIDDEN_STATES


@dataclass(frozen=True)
class StepInput:
    token_ids: tuple[int, ...] | None
    hidden: np.ndarray | None


def _check_compression(tensor: shard.NamedTensor | TensorParts, accepted: Collection[int]) -> None:
    if tensor.compression not in accepted:
        raise payload_corrupt(f"tensor {tensor.name!r}: compression was not agreed at open")


def _token_input(tensor: WireTensor, role: HopRole, token_count: int) -> StepInput:
    if tensor.dtype != shard.DTYPE_INT32 or tensor.array.shape != (token_count,):
        raise payload_corrupt(f"{TOKEN_IDS} must be INT32 [{token_count}]")
    ids = tensor.array.tolist()
    # llama.cpp aborts the process on an out-of-vocabulary id: refuse it here.
    if min(ids) < 0 or max(ids) >= role.vocab_size:
        raise payload_corrupt(f"{TOKEN_IDS} holds an id outside the vocabulary")
    return StepInput(token_ids=tuple(ids), hidden=None)


def _hidden_input(tensor: WireTensor, role: HopRole, token_count: int) -> StepInput:
    if tensor.dtype != role.boundary_dtype:
        raise payload_corrupt(f"{HIDDEN_STATES} is not in the route's boundary dtype")
    if tensor.array.shape != (token_count, role.hidden_size):
        raise payload_corrupt(f"{HIDDEN_STATES} must be [{token_count}, {role.hidden_size}]")
    hidden = tensor.as_float32()
    if not np.isfinite(hidden).all():
        raise payload_corrupt(f"{HIDDEN_STATES} holds non-finite values")
    return StepInput(token_ids=None, hidden=hidden)


def _role_input(tensor: WireTensor, role: HopRole, token_count: int) -> StepInput:
    if role.takes_tokens:
        return _token_input(tensor, role, token_count)
    return _hidden_input(tensor, role, token_count)


def decode_chunk_input(
    bundle: BundleParts, role: HopRole, token_count: int, accepted: Collection[int]
) -> StepInput:
    """The single input tensor of an ActivationChunk's bundle, or PAYLOAD_CORRUPT."""
    names = [t.name for t in bundle.tensors]
    if names != [role.input_name]:
        raise payload_corrupt(f"bundle must hold exactly one tensor named {role.input_name!r}")
    _check_compression(bundle.tensors[0], accepted)
    return _role_input(decode_bundle_parts(bundle)[role.input_name], role, token_count)


def decode_step_input(tensor: shard.NamedTensor, role: HopRole, accepted: Collection[int]) -> StepInput:
    """The one-token input of a DecodeStep, or PAYLOAD_CORRUPT."""
    if tensor.name != role.input_name:
        raise payload_corrupt(f"decode tensor must be named {role.input_name!r}")
    _check_compression(tensor, accepted)
    return _role_input(decode_tensor(tensor), role, 1)


def check_result(
    result: object,
    role: HopRole,
    n_tokens: int,
    *,
    sampled: bool,
    want_logits: bool,
    verify: bool = False,
) -> StepResult:
    """Refuse (INTERNAL) an engine result this hop could not honestly pass on. ``verify``: a
    verify step, whose sampled result is a token for each of its ``n_tokens`` positions."""
    if not isinstance(result, StepResult):
        raise _malformed()
    if role.is_tail:
        if sampled:
            token = result.token_id
            if not isinstance(token, int | np.integer) or not 0 <= int(token) < role.vocab_size:
                raise _malformed()
        if sampled and verify:
            tokens = result.token_ids
            if (
                not isinstance(tokens, tuple)
                or len(tokens) != n_tokens
                or not all(isinstance(t, int | np.integer) and 0 <= int(t) < role.vocab_size for t in tokens)
            ):
                raise _malformed()
        if sampled and want_logits:
            logits = result.logits
            if (
                not isinstance(logits, np.ndarray)
                or logits.shape != (role.vocab_size,)
                or not np.isfinite(logits).all()
            ):
                raise _malformed()
    else:
        hidden = result.hidden
        if (
            not isinstance(hidden, np.ndarray)
            or hidden.dtype != np.float32
            or hidden.shape != (n_tokens, role.hidden_size)
            or not np.isfinite(hidden).all()
        ):
            raise _malformed()
    return result


def _malformed() -> Exception:
    return refusal(shard.ERROR_CODE_INTERNAL, MALFORMED_RESULT_DETAIL)


def encode_token_result(token_id: int, logits: np.ndarray | None) -> shard.TensorBundle:
    """The tail's result. Without logits (every decode step of a real generation) the bundle for a
    token is encoded once and reused: callers only copy it into their messages, never change it."""
    if logits is None:
        cached = _TOKEN_BUNDLES.get(token_id)
        if cached is None:
            if len(_TOKEN_BUNDLES) >= _TOKEN_BUNDLES_KEPT:
                _TOKEN_BUNDLES.clear()
            cached = _TOKEN_BUNDLES[token_id] = encode_bundle(
                [encode_tensor(TOKEN_IDS, shard.DTYPE_INT32, np.array([token_id], dtype=np.int32))]
            )
        return cached
    tensors = [encode_tensor(TOKEN_IDS, shard.DTYPE_INT32, np.array([token_id], dtype=np.int32))]
    tensors.append(encode_float_tensor(LOGITS, logits, shard.DTYPE_FLOAT32))
    return encode_bundle(tensors)


def encode_verify_result(token_ids: tuple[int, ...], logits: np.ndarray | None) -> shard.TensorBundle:
    """The tail's result for a verify step: the choice after every position (then the last
    position's logits when the route asks for them)."""
    tensors = [encode_tensor(TOKEN_IDS, shard.DTYPE_INT32, np.array(token_ids, dtype=np.int32))]
    if logits is not None:
        tensors.append(encode_float_tensor(LOGITS, logits, shard.DTYPE_FLOAT32))
    return encode_bundle(tensors)


_TOKEN_BUNDLES: dict[int, shard.TensorBundle] = {}
_TOKEN_BUNDLES_KEPT = 4096


def encode_hidden(hidden: np.ndarray, dtype: int, compression: int) -> shard.NamedTensor:
    # The worker keeps a route's dtype and compression as plain ints (proto3 enums are open: any
    # int is a value); the encoder takes them typed as the protobuf stubs type the fields.
    return encode_float_tensor(
        HIDDEN_STATES, hidden, cast(shard.DType, dtype), compression=cast(shard.Compression, compression)
    )


def encode_tokens(token_ids: np.ndarray | list[int] | tuple[int, ...]) -> shard.NamedTensor:
    return encode_tensor(TOKEN_IDS, shard.DTYPE_INT32, np.asarray(token_ids, dtype=np.int32).reshape(-1))


__all__ = [
    "HIDDEN_STATES",
    "LOGITS",
    "TOKEN_IDS",
    "HopRole",
    "StepInput",
    "check_result",
    "decode_chunk_input",
    "decode_step_input",
    "encode_hidden",
    "encode_token_result",
    "encode_tokens",
    "encode_verify_result",
]
