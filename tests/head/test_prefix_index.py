"""The head's prefix cache bookkeeping, pure: block digests, the index of what routes keep, the
route preference, and the prefill grid."""

from __future__ import annotations

import pytest

from meshnode.dataplane.client_units import PrefixBlocks, prefill_pieces
from meshnode.head.planner import ModelIdentity, ShardCandidate, plan_route
from meshnode.head.prefix_index import PrefixIndex, block_digests, route_key
from meshnode.head.prefix_routes import preferred_route
from meshnode.wire.chunking import plan_prefill_chunks
from meshnode.wire.flow_control import default_flow_control
from meshnode.wire.pb import shard

MODEL = ModelIdentity("artifact", "recipe", 18)
SECRET = b"s" * 32
TOKENS = [(11 * i) % 97 for i in range(300)]


def node(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def candidate(name: str, start: int, end: int, **kwargs) -> ShardCandidate:
    return ShardCandidate(node(name), "gemma", MODEL, start, end, max_sessions=4, **kwargs)


def two_replicas(load_a: int = 0, load_b: int = 0) -> list[ShardCandidate]:
    return [
        candidate("head", 0, 6),
        candidate("a", 6, 18, active_sessions=load_a),
        candidate("b", 6, 18, active_sessions=load_b),
    ]


def route_through(name: str, candidates: list[ShardCandidate]):
    other = {"a": "b", "b": "a"}[name]
    return plan_route(candidates, MODEL, exclude=frozenset({node(other)}))


def test_a_digest_names_the_whole_prefix_and_depends_on_secret_route_and_grid() -> None:
    key = b"k" * 32
    digests = block_digests(SECRET, key, TOKENS, 128)
    assert len(digests) == 2  # whole blocks only
    assert block_digests(SECRET, key, TOKENS[:256], 128) == digests
    changed = [*TOKENS]
    changed[5] += 1
    # A change in the first block changes every later digest (a chain).
    assert all(a != b for a, b in zip(block_digests(SECRET, key, changed, 128), digests, strict=True))
    assert block_digests(b"t" * 32, key, TOKENS, 128) != digests
    assert block_digests(SECRET, b"j" * 32, TOKENS, 128) != digests
    candidates = two_replicas()
    via_a, via_b = route_through("a", candidates), route_through("b", candidates)
    assert route_key(via_a, 128, shard.DTYPE_FLOAT32) != route_key(via_b, 128, shard.DTYPE_FLOAT32)
    assert route_key(via_a, 128, shard.DTYPE_FLOAT32) != route_key(via_a, 64, shard.DTYPE_FLOAT32)
    assert route_key(via_a, 128, shard.DTYPE_FLOAT32) != route_key(via_a, 128, shard.DTYPE_FLOAT16)


def test_the_index_answers_the_longest_recorded_prefix_per_route_and_forgets_a_miss() -> None:
    index = PrefixIndex(shard.DTYPE_FLOAT32, secret=SECRET)
    candidates = two_replicas()
    via_a, via_b = route_through("a", candidates), route_through("b", candidates)
    long_prompt = [*TOKENS, *TOKENS]
    digests = index.digests(via_a, 128, long_prompt)
    assert len(digests) == 4
    index.record(via_a, 128, digests[:3])
    assert index.held_blocks(via_a, 128, digests) == 3
    assert index.held_blocks(via_b, 128, index.digests(via_b, 128, long_prompt)) == 0
    assert index.holders(MODEL, long_prompt) == [(via_a, 384)]
    # A prompt of exactly the kept blocks leaves its last block to prefill (its last token is computed).
    assert index.holders(MODEL, long_prompt[:384]) == [(via_a, 256)]
    index.forget(via_a, 128, digests[1])
    # The miss at block 2 says nothing of block 1, but the longer prefix is gone with it.
    assert index.held_blocks(via_a, 128, digests) == 1


def test_the_index_is_bounded() -> None:
    index = PrefixIndex(shard.DTYPE_FLOAT32, secret=SECRET, max_routes=1, max_prefixes_per_route=2)
    candidates = two_replicas()
    via_a, via_b = route_through("a", candidates), route_through("b", candidates)
    digests = index.digests(via_a, 128, [*TOKENS, *TOKENS])
    index.record(via_a, 128, digests)
    assert len(index) == 2 and index.held_blocks(via_a, 128, digests) == 4
    index.record(via_b, 128, index.digests(via_b, 128, TOKENS))
    assert index.held_blocks(via_a, 128, digests) == 0


def test_the_route_holding_the_prefix_wins_unless_full_gone_or_much_busier() -> None:
    candidates = two_replicas(load_a=1)
    cheapest = plan_route(candidates, MODEL)
    assert cheapest.hops[1].node_id == node("b")  # the idler replica
    via_a = route_through("a", candidates)
    assert preferred_route(cheapest, [(via_a, 256)], candidates, frozenset()) == (via_a, 256)
    # Much busier: its hop's share in use more than half above the cheapest route's busiest.
    busier = two_replicas(load_a=3)
    assert preferred_route(plan_route(busier, MODEL), [(via_a, 256)], busier, frozenset()) is None
    full = two_replicas(load_a=4)
    assert preferred_route(plan_route(full, MODEL), [(via_a, 256)], full, frozenset()) is None
    assert preferred_route(cheapest, [(via_a, 256)], candidates, frozenset({node("a")})) is None
    gone = [c for c in candidates if c.node_id != node("a")]
    assert preferred_route(plan_route(gone, MODEL), [(via_a, 256)], gone, frozenset()) is None
    # The cheapest route holding it already: nothing to prefer.
    assert preferred_route(via_a, [(via_a, 256)], candidates, frozenset()) is None


def test_grid_chunks_fall_on_multiples_of_the_grid_whatever_the_length_or_start() -> None:
    chunks = plan_prefill_chunks(300, max_prefill_chunk_tokens=128, grid=128)
    assert [(c.first_position, c.token_count) for c in chunks] == [(0, 128), (128, 128), (256, 44)]
    chunks = plan_prefill_chunks(200, first_position=100, max_prefill_chunk_tokens=128, grid=128)
    assert [(c.first_position, c.token_count) for c in chunks] == [(100, 28), (128, 128), (256, 44)]
    assert [c.final for c in chunks] == [False, False, True]
    with pytest.raises(ValueError, match="does not fit"):
        plan_prefill_chunks(300, max_prefill_chunk_tokens=64, grid=128)


def test_whole_block_pieces_carry_their_digest_and_the_first_names_the_kept_prefix() -> None:
    digests = [bytes([i]) * 16 for i in range(3)]
    blocks = PrefixBlocks(128, digests)
    pieces = prefill_pieces(
        TOKENS[256:],
        first_position=256,
        takes_tokens=True,
        boundary_dtype=shard.DTYPE_FLOAT32,
        flow=default_flow_control(),
        blocks=blocks,
    )
    assert [(p.position.first_position, p.position.token_count) for p in pieces] == [(256, 44)]
    assert pieces[0].position.prefix_digest == digests[1] and pieces[0].position.block_digest == b""
    pieces = prefill_pieces(
        TOKENS,
        first_position=0,
        takes_tokens=True,
        boundary_dtype=shard.DTYPE_FLOAT32,
        flow=default_flow_control(),
        blocks=blocks,
    )
    assert [p.position.block_digest for p in pieces] == [digests[0], digests[1], b""]
    assert all(p.position.prefix_digest == b"" for p in pieces)
    with pytest.raises(ValueError, match="no whole-block prefix"):
        blocks.start_digest(100)
