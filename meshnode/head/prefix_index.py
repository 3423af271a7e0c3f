"""Which routes' hops keep which prompt prefixes, as this head last left them. Pure.

A prefill's chunks fall on a grid of ``grid`` positions; each chunk that is one whole block
carries the digest of every token up to its end (:func:`block_digests`), and every hop keeps,
when the session ends, the blocks it computed that way (engines.session_table). On a route whose
every hop computes a prefill row alike in any pass of 8 rows or more (``Route.keeps_partial_blocks``)
the prompt's last chunk, when that large, carries its digest too (:func:`partial_digest`), so the
next turn starts after the whole prompt rather than after its last whole block. A digest is a
chain: block ``i``'s digest covers block ``i - 1``'s, so one digest names a whole prefix. It is
keyed twice: by this head's secret, so that no one without it can name (and so probe for) a
prefix another client sent, and by the route (:func:`route_key`: its hops, their layer ranges
and numerics, the boundary dtype and the grid), because a downstream hop's cache depends on the
activations the hops before it sent, not only on the tokens.

:class:`PrefixIndex` remembers, per route, the digests of the prefixes its hops were left
holding (least recently used first, bounded), answers how much of a new prompt a route holds,
and which routes hold some of it. It is a hint: a hop may have dropped a prefix for room or age
since, which costs one refused unit and a normal prefill (meshnode.head.route_decoding).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshnode.head.planner import ModelIdentity, Route

# Tokens per block of the prefill grid (at most a chunk's limit; llama.cpp's n_batch is larger, so
# the runtime never splits a chunk again).
PREFIX_GRID_TOKENS = 128
DIGEST_BYTES = 16
# Routes remembered, and prefixes per route (each kept prefix's every block counts as one).
MAX_ROUTES = 64
MAX_PREFIXES_PER_ROUTE = 4096


def route_key(route: Route, grid: int, boundary_dtype: int) -> bytes:
    """What a kept prefix's KV depends on besides its tokens."""
    parts = [
        route.model.model_artifact_digest,
        route.model.runtime_recipe_digest,
        str(route.model.total_layers),
        f"grid={grid}",
        f"boundary={boundary_dtype}",
    ]
    for hop in route.hops:
        parts.append(
            f"{hop.node_id.hex()}:{hop.start_layer}:{hop.end_layer}:{hop.effective_start_layer}:{hop.numerics}"
        )
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=32).digest()


def block_digests(secret: bytes, key: bytes, tokens: Sequence[int], grid: int) -> list[bytes]:
    """The digest of each whole block of ``tokens`` on the grid: ``[i]`` names ``tokens[: (i + 1) * grid]``."""
    ids = np.asarray(tokens, dtype="<i4")
    digests = []
    previous = key
    for start in range(0, len(ids) - grid + 1, grid):
        hasher = hashlib.blake2b(previous, digest_size=DIGEST_BYTES, key=secret)
        hasher.update(ids[start : start + grid].tobytes())
        previous = hasher.digest()
        digests.append(previous)
    return digests


def partial_digest(secret: bytes, key: bytes, tokens: Sequence[int], grid: int, length: int) -> bytes:
    """The digest of ``tokens[:length]`` where ``length`` is off the grid (a prefix a route whose hops
    keep partial blocks may hold): the last whole block's digest chained with the tokens after it."""
    if not 0 < length <= len(tokens) or not length % grid:
        raise ValueError(f"{length} is not a partial prefix of {len(tokens)} tokens on a grid of {grid}")
    whole = length // grid * grid
    previous = block_digests(secret, key, tokens[:whole], grid)[-1] if whole else key
    hasher = hashlib.blake2b(previous, digest_size=DIGEST_BYTES, key=secret, person=b"partial-block")
    hasher.update(np.asarray(tokens[whole:length], dtype="<i4").tobytes())
    return hasher.digest()


def partial_start_allowed(length: int, prompt_tokens: int, grid: int, min_rows: int) -> bool:
    """Whether a prefill of ``prompt_tokens`` may start after a kept prefix of ``length`` positions
    that ends off the grid, computing every later position in a pass of the same kind as the fresh
    prefill on the grid does (engines.row_invariance: passes of ``min_rows`` rows or more round a
    row alike whatever their size, smaller ones otherwise). Its passes are of ``min_rows`` or more
    (the prefill's first chunk grows to that, meshnode.wire.chunking), so it needs that many
    positions to compute; and where the fresh prefill's last chunk is smaller than that, the same
    last chunk, after at least ``min_rows`` positions of its own."""
    if not 0 < length < prompt_tokens or prompt_tokens - length < min_rows:
        return False
    last_chunk = prompt_tokens % grid
    return not 0 < last_chunk < min_rows or length <= prompt_tokens - last_chunk - min_rows


@dataclass
class _RoutePrefixes:
    route: Route
    grid: int
    key: bytes
    # Digest -> the prefix's length in tokens, least recently used first.
    lengths: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    # How many of ``lengths`` end off the grid at each length (what a lookup tries).
    partial_lengths: Counter[int] = field(default_factory=Counter)

    def add(self, digest: bytes, length: int) -> None:
        if digest not in self.lengths and length % self.grid:
            self.partial_lengths[length] += 1
        self.lengths[digest] = length
        self.lengths.move_to_end(digest)

    def drop(self, digest: bytes) -> int | None:
        length = self.lengths.pop(digest, None)
        if length is not None and length % self.grid:
            self.partial_lengths[length] -= 1
            if not self.partial_lengths[length]:
                del self.partial_lengths[length]
        return length


class PrefixIndex:
    def __init__(
        self,
        boundary_dtype: int,
        *,
        secret: bytes | None = None,
        max_routes: int = MAX_ROUTES,
        max_prefixes_per_route: int = MAX_PREFIXES_PER_ROUTE,
    ) -> None:
        self._boundary_dtype = boundary_dtype
        self._secret = secret if secret is not None else os.urandom(32)
        self._max_routes = max_routes
        self._max_prefixes = max_prefixes_per_route
        # Route key -> what its hops hold, least recently used first.
        self._routes: OrderedDict[bytes, _RoutePrefixes] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(held.lengths) for held in self._routes.values())

    def digests(self, route: Route, grid: int, tokens: Sequence[int]) -> list[bytes]:
        """Each whole block's digest of ``tokens`` on ``route`` (what its prefill chunks carry)."""
        return block_digests(self._secret, route_key(route, grid, self._boundary_dtype), tokens, grid)

    def held_blocks(self, route: Route, grid: int, digests: Sequence[bytes]) -> int:
        """How many of the leading blocks named by ``digests`` the route's hops were left holding."""
        held = self._routes.get(route_key(route, grid, self._boundary_dtype))
        if held is None:
            return 0
        for count in range(len(digests), 0, -1):
            if digests[count - 1] in held.lengths:
                held.lengths.move_to_end(digests[count - 1])
                return count
        return 0

    def partial_digest(self, route: Route, grid: int, tokens: Sequence[int], length: int) -> bytes:
        """The digest of ``tokens[:length]``, ``length`` off the grid, on ``route``."""
        key = route_key(route, grid, self._boundary_dtype)
        return partial_digest(self._secret, key, tokens, grid, length)

    def held_partial(
        self, route: Route, grid: int, tokens: Sequence[int], after: int, min_rows: int
    ) -> tuple[int, bytes] | None:
        """The longest prefix of ``tokens`` ending off the grid, past ``after`` and in its block, that
        the route's hops were left holding and a prefill may start from (:func:`partial_start_allowed`)."""
        held = self._routes.get(route_key(route, grid, self._boundary_dtype))
        if held is None:
            return None
        tried = sorted(
            (length for length in held.partial_lengths if after < length < after + grid), reverse=True
        )
        for length in tried:
            if not partial_start_allowed(length, len(tokens), grid, min_rows):
                continue
            digest = partial_digest(self._secret, held.key, tokens, grid, length)
            if held.lengths.get(digest) == length:
                held.lengths.move_to_end(digest)
                return length, digest
        return None

    def record(
        self, route: Route, grid: int, digests: Sequence[bytes], partial: Mapping[int, bytes] | None = None
    ) -> None:
        """The route's hops now hold the prefix whose blocks are ``digests`` (and so each shorter one),
        and the prefixes ending off the grid in ``partial`` (length -> digest)."""
        if not digests and not partial:
            return
        key = route_key(route, grid, self._boundary_dtype)
        held = self._routes.get(key)
        if held is None:
            held = self._routes[key] = _RoutePrefixes(route, grid, key)
        self._routes.move_to_end(key)
        for index, digest in enumerate(digests):
            held.add(digest, (index + 1) * grid)
        for length, digest in sorted((partial or {}).items()):
            held.add(digest, length)
        while len(held.lengths) > self._max_prefixes:
            held.drop(next(iter(held.lengths)))
        while len(self._routes) > self._max_routes:
            self._routes.popitem(last=False)

    def forget(self, route: Route, grid: int, digest: bytes) -> None:
        """A hop of ``route`` no longer held the prefix ``digest``: nor any longer one, for all this
        head knows (which hop dropped it is not said)."""
        held = self._routes.get(route_key(route, grid, self._boundary_dtype))
        if held is None:
            return
        length = held.drop(digest)
        if length is None:
            return
        for other, other_length in list(held.lengths.items()):
            if other_length > length:
                held.drop(other)

    def holders(self, model: ModelIdentity, tokens: Sequence[int]) -> list[tuple[Route, int]]:
        """The routes of ``model`` holding a prefix of ``tokens`` worth starting from (at least one
        block, leaving a token to prefill), with its length, the longest first."""
        found = []
        for held in self._routes.values():
            if held.route.model != model or len(tokens) <= held.grid:
                continue
            usable = (len(tokens) - 1) // held.grid * held.grid
            digests = block_digests(self._secret, held.key, tokens[:usable], held.grid)
            blocks = self.held_blocks(held.route, held.grid, digests)
            if blocks:
                found.append((held.route, blocks * held.grid))
        found.sort(key=lambda pair: -pair[1])
        return found


__all__ = [
    "DIGEST_BYTES",
    "PREFIX_GRID_TOKENS",
    "PrefixIndex",
    "block_digests",
    "partial_digest",
    "partial_start_allowed",
    "route_key",
]
