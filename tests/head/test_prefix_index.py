"""The head's prefix cache bookkeeping, pure: block digests, the index of what routes keep, the
route preference, and the prefill grid."""

from __future__ import annotations

import pytest

from meshnode.dataplane.client_units import PrefixBlocks, prefill_pieces
from meshnode.head.planner import ModelIdentity, ShardCandidate, plan_route
from meshnode.head.prefix_index import (
    PrefixIndex,
    block_digests,
    partial_digest,
    partial_start_allowed,
    route_key,
)
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
    with pytest.raises(ValueError, match="no kept prefix ends at position 100"):
        blocks.start_digest(100)


def test_a_partial_digest_names_the_prefix_up_to_its_length_off_the_grid() -> None:
    key = b"k" * 32
    whole = block_digests(SECRET, key, TOKENS, 128)
    partial = partial_digest(SECRET, key, TOKENS, 128, 300)
    assert partial not in whole
    # The tokens past the length do not enter it; every token before it does.
    assert partial_digest(SECRET, key, [*TOKENS, 1, 2], 128, 300) == partial
    changed = [*TOKENS]
    changed[5] += 1
    assert partial_digest(SECRET, key, changed, 128, 300) != partial
    assert partial_digest(SECRET, key, TOKENS, 128, 299) != partial
    assert partial_digest(SECRET, key, TOKENS, 128, 60) != partial_digest(SECRET, b"j" * 32, TOKENS, 128, 60)
    with pytest.raises(ValueError, match="not a partial prefix"):
        partial_digest(SECRET, key, TOKENS, 128, 256)


def test_a_partial_start_needs_a_first_chunk_of_the_floor_s_rows() -> None:
    # From 300: the first chunk runs to the next grid point (384), or to the prompt's end, and
    # needs 8 rows.
    assert partial_start_allowed(300, 400, 128, 8)
    assert partial_start_allowed(300, 308, 128, 8)
    assert not partial_start_allowed(300, 307, 128, 8)  # a 7-row pass
    assert partial_start_allowed(380, 500, 128, 8)  # 380-384, 4 rows, grows to 8 past 384
    assert not partial_start_allowed(300, 300, 128, 8)  # nothing left to compute


def test_the_index_keeps_partial_prefixes_finds_the_longest_and_forgets_them() -> None:
    index = PrefixIndex(shard.DTYPE_FLOAT32, secret=SECRET, max_prefixes_per_route=4)
    route = plan_route([candidate("head", 0, 18)], MODEL)
    first = TOKENS[:300]
    index.record(
        route, 128, index.digests(route, 128, first), {300: index.partial_digest(route, 128, first, 300)}
    )
    second = [*TOKENS, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]
    assert index.held_blocks(route, 128, index.digests(route, 128, second)) == 2
    length, digest = index.held_partial(route, 128, second, 256, 8) or (0, b"")
    assert length == 300 and digest == index.partial_digest(route, 128, second, 300)
    # A prompt that differs inside the partial block, or leaves too small a first chunk, gets none.
    other = [*TOKENS[:290], 1, *TOKENS[291:], 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    assert index.held_partial(route, 128, other, 256, 8) is None
    assert index.held_partial(route, 128, [*TOKENS, 1, 2, 3], 256, 8) is None
    index.forget(route, 128, digest)
    assert index.held_partial(route, 128, second, 256, 8) is None
    assert index.held_blocks(route, 128, index.digests(route, 128, second)) == 2
    # Bounded: the oldest prefixes go, partial ones with their count of lengths.
    for length in (260, 270, 280, 290):
        index.record(route, 128, [], {length: index.partial_digest(route, 128, TOKENS, length)})
    assert len(index) == 4
    assert index.held_partial(route, 128, TOKENS, 256, 8) == (
        290,
        index.partial_digest(route, 128, TOKENS, 290),
    )


def test_partial_blocks_carry_their_digest_from_the_floor_s_rows_and_a_start_names_one() -> None:
    digests = [bytes([i]) * 16 for i in range(3)]
    ends = {300: b"p" * 16, 380: b"q" * 16}
    blocks = PrefixBlocks(128, digests, ends, 8)
    pieces = prefill_pieces(
        [*TOKENS, *TOKENS][300:380],
        first_position=300,
        takes_tokens=True,
        boundary_dtype=shard.DTYPE_FLOAT32,
        flow=default_flow_control(),
        blocks=blocks,
    )
    assert [(p.position.first_position, p.position.token_count) for p in pieces] == [(300, 80)]
    assert pieces[0].position.prefix_digest == b"p" * 16 and pieces[0].position.block_digest == b"q" * 16
    # A cut chunk ending on the grid carries that block's digest; too small a partial one none.
    assert blocks.block_digest(300, 84) == digests[2]
    assert blocks.block_digest(256, 44) == b"p" * 16
    assert blocks.block_digest(376, 4) == b""
    # Without the floor (a hop whose rows depend on the pass): whole blocks only.
    assert PrefixBlocks(128, digests, ends).block_digest(256, 44) == b""
    assert PrefixBlocks(128, digests, ends).block_digest(0, 128) == digests[0]


def test_a_route_keeps_partial_blocks_only_when_every_hop_does() -> None:
    keeping = [
        candidate("head", 0, 6, keeps_partial_blocks=True),
        candidate("a", 6, 18, keeps_partial_blocks=True),
    ]
    assert plan_route(keeping, MODEL).keeps_partial_blocks
    mixed = [keeping[0], candidate("a", 6, 18)]
    assert not plan_route(mixed, MODEL).keeps_partial_blocks


def test_a_first_chunk_short_of_the_grid_point_merges_or_grows_to_the_floor() -> None:
    def spans(n: int, first: int, bound: int = 128) -> list[tuple[int, int]]:
        chunks = plan_prefill_chunks(
            n, first_position=first, max_prefill_chunk_tokens=bound, grid=128, min_rows=8
        )
        return [(c.first_position, c.token_count) for c in chunks]

    # 253-256 is 3 rows: it grows to 8 at the next block's expense (both do not fit 128).
    assert spans(200, 253) == [(253, 8), (261, 123), (384, 69)]
    # Where both fit the bound it is merged instead.
    assert spans(13, 253) == [(253, 13)]
    assert spans(200, 253, bound=256) == [(253, 131), (384, 69)]
    # A first chunk of 8 rows or more is left as it is, as is one with nothing after it.
    assert spans(200, 248) == [(248, 8), (256, 128), (384, 64)]
    assert spans(3, 253) == [(253, 3)]


def test_a_partial_start_keeps_the_fresh_prefill_s_small_last_chunk_as_it_is() -> None:
    # The fresh prefill of 386 tokens ends with a 2-row chunk (384-386): a start must leave it
    # alone, after 8 rows of its own.
    assert partial_start_allowed(300, 386, 128, 8)
    assert partial_start_allowed(376, 386, 128, 8)
    assert not partial_start_allowed(377, 386, 128, 8)
    # Ending on the grid or with a last chunk of 8 or more: 8 rows to compute suffice.
    assert partial_start_allowed(376, 384, 128, 8)
    assert partial_start_allowed(382, 392, 128, 8)
