"""SessionRoute: validation at the receiving worker, and the onward route for the next hop."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.interface import GREEDY, SamplingParams
from engines.request_limits import MAX_GRAMMAR_BYTES, MAX_PENALTY_LAST_N
from engines.sampling import with_history
from meshnode.dataplane.errors import payload_corrupt, refusal
from meshnode.dataplane.route_limits import MAX_ROUTE_HOPS
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.pb import shard

# OpenAI allows 300 biased tokens; a route carrying more is refused.
MAX_LOGIT_BIASES = 1024
NODE_ID_BYTES = 32
BOUNDARY_DTYPES = (shard.DTYPE_FLOAT32, shard.DTYPE_BFLOAT16)
ROUTE_COMPRESSIONS = (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD)


@dataclass(frozen=True)
class RoutePlan:
    """A validated route as one worker acts on it."""

    message: dataplane.SessionRoute
    boundary_dtype: int
    compression: int
    sampling: SamplingParams
    return_logits: bool
    # How many stages the head keeps busy at once (meshnode.dataplane.cohorts); 0: none.
    pipeline_stages: int
    # The hop this worker forwards to, and the route that hop receives; both None
    # when this worker returns its result to the sender.
    next_hop: dataplane.RouteHop | None
    onward: dataplane.SessionRoute | None


def make_route(
    downstream: tuple[dataplane.RouteHop, ...] | list[dataplane.RouteHop] = (),
    *,
    sampling: SamplingParams = GREEDY,
    boundary_dtype: shard.DType = shard.DTYPE_FLOAT32,
    compression: shard.Compression = shard.COMPRESSION_NONE,
    return_logits: bool = False,
    pipeline_stages: int = 0,
) -> dataplane.SessionRoute:
    return dataplane.SessionRoute(
        gen=NODE_PROTOCOL_GENERATION,
        downstream=list(downstream),
        sampling=sampling_to_pb(sampling),
        boundary_dtype=boundary_dtype,
        compression=compression,
        return_logits=return_logits,
        pipeline_stages=pipeline_stages,
    )


def make_hop(
    node_id: bytes, start_layer: int, end_layer: int, effective_start_layer: int
) -> dataplane.RouteHop:
    return dataplane.RouteHop(
        node_id=node_id,
        shard_range=shard.ShardRange(
            start_layer=start_layer, end_layer=end_layer, effective_start_layer=effective_start_layer
        ),
    )


def sampling_to_pb(params: SamplingParams) -> dataplane.SamplingParams:
    return dataplane.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repeat_penalty=params.repeat_penalty,
        penalty_last_n=params.penalty_last_n,
        logit_bias=[dataplane.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        recent_tokens=params.recent_tokens,
        recent_tokens_end=params.recent_tokens_end,
        grammar=params.grammar,
    )


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise payload_corrupt(f"sampling {name} must be finite")
    return value


def sampling_from_pb(message: dataplane.SamplingParams) -> SamplingParams:
    """The tail's sampling parameters; PAYLOAD_CORRUPT for values no sampler can act on."""
    if not math.isfinite(message.temperature) or message.temperature < 0:
        raise payload_corrupt("sampling temperature must be finite and non-negative")
    if not math.isfinite(message.top_p) or not 0.0 <= message.top_p <= 1.0:
        raise payload_corrupt("sampling top_p must lie in [0, 1]")
    if not math.isfinite(message.min_p) or not 0.0 <= message.min_p <= 1.0:
        raise payload_corrupt("sampling min_p must lie in [0, 1]")
    if not math.isfinite(message.repeat_penalty) or message.repeat_penalty < 0:
        raise payload_corrupt("sampling repeat_penalty must be finite and non-negative")
    if message.penalty_last_n > MAX_PENALTY_LAST_N or len(message.recent_tokens) > message.penalty_last_n:
        raise payload_corrupt(f"sampling penalty window over {MAX_PENALTY_LAST_N} tokens")
    if len(message.recent_tokens) > message.recent_tokens_end:
        raise payload_corrupt("sampling recent tokens reach before position 0")
    if len(message.grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise payload_corrupt(f"sampling grammar over {MAX_GRAMMAR_BYTES} bytes")
    if len(message.logit_bias) > MAX_LOGIT_BIASES:
        raise payload_corrupt(f"more than {MAX_LOGIT_BIASES} logit biases")
    # proto3 cannot tell unset from 0: a top_p of 0 is nucleus sampling off (the API sends
    # a greedy request for top_p 0), a repeat_penalty of 0 is no penalty.
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.top_p > 0 else 1.0,
        seed=message.seed,
        min_p=message.min_p,
        presence_penalty=_finite(message.presence_penalty, "presence_penalty"),
        frequency_penalty=_finite(message.frequency_penalty, "frequency_penalty"),
        repeat_penalty=message.repeat_penalty if message.repeat_penalty > 0 else 1.0,
        penalty_last_n=message.penalty_last_n,
        logit_bias=tuple(
            sorted((bias.token_id, _finite(bias.bias, "logit bias")) for bias in message.logit_bias)
        ),
        recent_tokens=tuple(message.recent_tokens),
        recent_tokens_end=message.recent_tokens_end,
        grammar=message.grammar,
    )


def _range_mismatch(detail: str) -> Exception:
    return refusal(shard.ERROR_CODE_SHARD_RANGE_MISMATCH, detail)


def _check_hops(hops: list[dataplane.RouteHop], start_at: int) -> None:
    expected_start = start_at
    for index, hop in enumerate(hops):
        if len(hop.node_id) != NODE_ID_BYTES:
            raise payload_corrupt(f"route hop {index}: node id must be {NODE_ID_BYTES} bytes")
        r = hop.shard_range
        if not r.start_layer <= r.effective_start_layer < r.end_layer:
            raise _range_mismatch(f"route hop {index}: effective start outside its range")
        if r.effective_start_layer != expected_start:
            raise _range_mismatch(
                f"route hop {index} starts at {r.effective_start_layer}, not {expected_start}"
            )
        expected_start = r.end_layer


def validate_route(route: dataplane.SessionRoute, *, end_layer: int, is_tail: bool) -> RoutePlan:
    """Refuse a route this worker (serving up to ``end_layer``) cannot act on.

    A wrong generation is SCHEMA_UNSUPPORTED; hops that do not continue where the
    previous one stopped, or any hop after the tail, SHARD_RANGE_MISMATCH;
    malformed fields PAYLOAD_CORRUPT.
    """
    if route.gen != NODE_PROTOCOL_GENERATION:
        raise refusal(shard.ERROR_CODE_SCHEMA_UNSUPPORTED, f"route generation {route.gen} is not supported")
    hops = list(route.downstream)
    if len(hops) > MAX_ROUTE_HOPS:
        raise payload_corrupt(f"route has more than {MAX_ROUTE_HOPS} hops")
    if hops and is_tail:
        raise _range_mismatch("the tail cannot forward to further hops")
    _check_hops(hops, end_layer)
    dtype = route.boundary_dtype or shard.DTYPE_FLOAT32
    if dtype not in BOUNDARY_DTYPES:
        raise payload_corrupt("route boundary dtype must be FLOAT32 or BFLOAT16")
    compression = route.compression or shard.COMPRESSION_NONE
    if compression not in ROUTE_COMPRESSIONS:
        raise payload_corrupt("route compression must be NONE or ZSTD")
    if route.pipeline_stages > MAX_ROUTE_HOPS + 1:
        raise payload_corrupt(f"route has more than {MAX_ROUTE_HOPS + 1} pipeline stages")
    sampling = sampling_from_pb(route.sampling)
    if is_tail:
        # The plan lives as long as the session and epoch it opened: so does the history.
        sampling = with_history(sampling)
    next_hop: dataplane.RouteHop | None = None
    onward: dataplane.SessionRoute | None = None
    if hops:
        next_hop = hops[0]
        onward = dataplane.SessionRoute()
        onward.CopyFrom(route)
        del onward.downstream[0]
    return RoutePlan(
        message=route,
        boundary_dtype=dtype,
        compression=compression,
        sampling=sampling,
        return_logits=route.return_logits,
        pipeline_stages=route.pipeline_stages,
        next_hop=next_hop,
        onward=onward,
    )


__all__ = [
    "BOUNDARY_DTYPES",
    "MAX_ROUTE_HOPS",
    "NODE_ID_BYTES",
    "RoutePlan",
    "make_hop",
    "make_route",
    "sampling_from_pb",
    "sampling_to_pb",
    "validate_route",
]
