"""A generation's tokens from its route's open session: the (re)build of its caches, then one round trip a step.

:meth:`RouteDecoder.replay` prefills the prompt in pipelined chunks and, after a
failure, replays the session's tokens (:mod:`meshnode.head.transcript`) so that
decoding continues at the right position with the output an unbroken run would have
produced. :meth:`RouteDecoder.decode` then runs one step a round trip.

Speculative decoding (:mod:`meshnode.head.speculation`, ``DriverConfig.speculation``):
for a greedy or seeded sampled request the head drafts tokens by prompt lookup and
sends them with its last token as one verify step; the tail's choice after every
position says how many to keep, 1 to k + 1 tokens a round trip, the very tokens plain
decoding gives. The next step asks every hop to drop the rejected drafts
(``rollback``). Only accepted tokens enter the transcript, so a replay after a failure
rebuilds exactly the accepted caches. Penalised and grammar requests decode one token
at a time, as do routes with a hop that does not announce verify steps
(``ServedShard.verifies_drafts``: a node predating them).

Prefix cache (:mod:`meshnode.head.prefix_index`): the prompt's prefill chunks fall on a grid
of absolute positions, and each whole block carries its digest, so every hop keeps those
blocks when the session ends. A replay whose route holds a prefix of the prompt starts after
it: its first chunk names the prefix, and each hop opens the session from what it kept,
computing every later chunk exactly as a fresh prefill on the grid would. A hop that no longer
keeps it refuses that chunk (``CACHE_MISS`` at length 0); the replay then prefills from
position 0, one round trip later, and the route's record is forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from engines.interface import MIN_SIZE_FREE_PASS_ROWS, SamplingParams, supports_speculation
from meshnode.dataplane.client_units import PrefixBlocks
from meshnode.dataplane.edges.shard_session import ShardSession, StepOutput
from meshnode.dataplane.edges.unit_futures import UnitHandle
from meshnode.head.driver_config import DriverConfig
from meshnode.head.driver_stats import DriverStats
from meshnode.head.planner import Route
from meshnode.head.prefix_index import PREFIX_GRID_TOKENS, PrefixIndex
from meshnode.head.route_session import RouteSession
from meshnode.head.speculation import SpeculationConfig, Speculator
from meshnode.head.stall_watchdog import StallWatchdog
from meshnode.head.transcript import Transcript
from meshnode.sansio import SECOND_NS
from meshnode.wire.chunking import plan_prefill_chunks
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefilledBlocks:
    """What the last replay's prefill left on its route: the grid and each whole block's digest
    (the hops keep these blocks when the session ends), and the prompt's own digest where its last
    chunk, off the grid, was kept too."""

    route: Route
    grid: int
    digests: Sequence[bytes]
    partial: Mapping[int, bytes] = field(default_factory=dict)


class RouteDecoder:
    def __init__(
        self,
        options: DriverConfig,
        stats: DriverStats,
        transcript: Transcript,
        sampling: SamplingParams,
        max_tokens: int,
        watchdog: StallWatchdog,
        prefixes: PrefixIndex | None = None,
    ) -> None:
        self._options = options
        # None: the prefix cache is off (the chunks still fall on the grid, so the text is the same).
        self._prefixes = prefixes
        # A hop refused to start from a kept prefix: this generation prefills from 0 from now on.
        self._prefix_missed = False
        self.prefilled: PrefilledBlocks | None = None
        self._stats = stats
        self._transcript = transcript
        self._max_tokens = max_tokens
        self._watchdog = watchdog
        # Speculative decoding, for a greedy or seeded sampled request when the options allow it.
        self._speculator: Speculator | None = None
        if options.speculation and supports_speculation(sampling):
            draft_max = options.draft_max
            self._speculator = Speculator(
                SpeculationConfig(max_draft=draft_max, initial_draft=min(4, draft_max))
            )
        # The route's caches may hold rejected drafts of the last verify round beyond the accepted
        # tokens: the next step asks every hop to drop them.
        self._rollback = False
        # Prompt tokens the last replay did not prefill: the hops started from a kept prefix.
        self.cached_tokens = 0
        # The most tokens a prefill chunk carries on the route's session (set with its blocks).
        self._chunk_tokens = PREFIX_GRID_TOKENS

    def stop_speculating(self) -> bool:
        """Decode token by token from now on; False when it already did (nothing changes)."""
        if self._speculator is None:
            return False
        self._speculator = None
        return True

    def _deadline_unix_ns(self, queued: int = 0) -> int:
        allowance = self._options.unit_timeout_s + queued * self._options.queued_unit_allowance_s
        return time.time_ns() + int(allowance * SECOND_NS)

    async def replay(self, route: RouteSession, *, only_after_prefix: bool = False) -> int | None:
        """(Re)build the route's caches from the transcript. Before the first token this is the
        prompt's prefill and returns the first token; later it returns None. A hop that no longer
        keeps the prefix it starts from sends it back to position 0; with ``only_after_prefix`` it
        never prefills from 0: :class:`LookupError` when the route holds no prefix of the prompt,
        the ``CACHE_MISS`` when a hop no longer keeps it."""
        session = route.session
        assert session is not None
        # Rebuilt from the transcript: nothing but accepted tokens (a prefill from position 0, or
        # from a prefix the hops kept, which computes the same).
        self._rollback = False
        blocks, start = self._prefix_start(route, session)
        if only_after_prefix and not start:
            raise LookupError("the route holds no prefix of the prompt")
        try:
            return await self._replay_from(route, session, blocks, start)
        except ShardProtocolError as error:
            if not start or error.code != shard.ERROR_CODE_CACHE_MISS:
                raise
            self._missed_prefix(route, blocks, start)
            if only_after_prefix:
                raise
        return await self._replay_from(route, session, blocks, 0)

    def _prefix_start(self, route: RouteSession, session: ShardSession) -> tuple[PrefixBlocks, int]:
        """The prompt's grid and block digests, and where its prefill starts: after the longest prefix
        the route's hops were left holding, never at the prompt's end (its last token is computed)."""
        self._chunk_tokens = session.client.prefill_chunk_tokens()
        grid = min(PREFIX_GRID_TOKENS, self._chunk_tokens)
        prompt, planned, prefixes = self._transcript.prompt, route.route, self._prefixes
        self.cached_tokens = 0
        if prefixes is None or planned is None:
            self.prefilled = None
            return PrefixBlocks(grid, ()), 0
        digests = prefixes.digests(planned, grid, prompt)
        partial: dict[int, bytes] = {}
        if planned.keeps_partial_blocks and len(prompt) % grid:
            partial[len(prompt)] = prefixes.partial_digest(planned, grid, prompt, len(prompt))
        min_rows = MIN_SIZE_FREE_PASS_ROWS if planned.keeps_partial_blocks else 0
        start = 0
        if not self._prefix_missed:
            start = min(prefixes.held_blocks(planned, grid, digests), (len(prompt) - 1) // grid) * grid
            kept = None
            if min_rows:
                kept = prefixes.held_partial(planned, grid, prompt, start, min_rows)
            if kept is not None:
                start = kept[0]
                partial[start] = kept[1]
                grown_end = start + min_rows
                if (start // grid + 1) * grid < grown_end < len(prompt):
                    # Its first chunk, short of the grid point, may grow past it (wire.chunking).
                    partial[grown_end] = prefixes.partial_digest(planned, grid, prompt, grown_end)
        blocks = PrefixBlocks(grid, digests, partial, min_rows)
        kept_end = _kept_prompt_end(blocks, len(prompt), start, self._chunk_tokens)
        self.prefilled = PrefilledBlocks(planned, grid, digests, kept_end)
        return blocks, start

    def _missed_prefix(self, route: RouteSession, blocks: PrefixBlocks, start: int) -> None:
        self._prefix_missed = True
        self._stats.prefix_misses += 1
        planned = route.route
        if self._prefixes is not None and planned is not None:
            self._prefixes.forget(planned, blocks.grid, blocks.start_digest(start))
        log.info(
            "generation %s: a hop no longer keeps the prompt's first %d tokens; prefilling from position 0",
            route.route_session_id[:8],
            start,
        )

    async def _replay_from(
        self, route: RouteSession, session: ShardSession, blocks: PrefixBlocks, start: int
    ) -> int | None:
        transcript, watchdog = self._transcript, self._watchdog
        # Every prefill chunk gets a unit's whole time after the one before it: a chunk is one
        # unit of compute, and a wide model takes seconds a chunk (Llama 3 8B's shape on 2 cores
        # prefills ~11 tokens/s: ~95 s for the eight 128-token chunks of 1024 tokens), so one
        # deadline for the whole prompt expired mid-prompt and the generation re-routed,
        # prefilled again and expired again.
        unit_ns = round(self._options.unit_timeout_s * SECOND_NS)
        prefill = session.submit_prefill(
            transcript.prompt[start:],
            first_position=start,
            deadline_unix_ns=self._deadline_unix_ns(),
            blocks=blocks,
            chunk_allowance_ns=unit_ns,
        )
        steps = transcript.replay_steps()
        behind_prefill_ns = (len(prefill) - 1) * unit_ns
        decodes = [
            session.submit_decode(
                step.token,
                position=step.position,
                deadline_unix_ns=self._deadline_unix_ns(index + 1) + behind_prefill_ns,
            )
            for index, step in enumerate(steps)
        ]
        watchdog.waiting()
        output: StepOutput | None = None
        try:
            for handle in prefill:
                output = await handle
                route.mark_admitted()
                watchdog.waiting()
        except ShardProtocolError as error:
            if start and error.code == shard.ERROR_CODE_CACHE_MISS:
                # The units after the refused one fail too: settle them before prefilling again.
                await _settle([*prefill, *decodes], self._options.control_timeout_s)
            raise
        assert output is not None
        if self.prefilled is not None and not start and self.prefilled.partial:
            # From 0 after a refused start: the prompt's last chunk is the grid's, not the one planned.
            kept_end = _kept_prompt_end(blocks, len(transcript.prompt), 0, self._chunk_tokens)
            self.prefilled = replace(self.prefilled, partial=kept_end)
        if start:
            self.cached_tokens = start
            self._stats.prefix_hits += 1
            self._stats.prefix_cached_tokens += start
        first = _token(output)
        if transcript.started:
            self._check_replay(route, first, transcript.generated[0], len(transcript.prompt))
            for step, handle in zip(steps, decodes, strict=True):
                self._check_replay(route, _token(await handle), step.expected, step.position + 1)
                watchdog.waiting()
            if steps:
                log.info(
                    "generation %s: replayed %d tokens on the new route",
                    route.route_session_id[:8],
                    len(transcript.prompt) + len(steps),
                )
            watchdog.answered()
            return None
        watchdog.answered()
        return first

    def _check_replay(self, route: RouteSession, sampled: int, expected: int, position: int) -> None:
        if sampled != expected:
            self._stats.replay_mismatches += 1
            log.warning(
                "generation %s: the replay sampled %d at position %d where the original run sampled %d "
                "(the new route computes differently); keeping the original",
                route.route_session_id[:8],
                sampled,
                position,
                expected,
            )

    async def decode(self, route: RouteSession) -> tuple[int, ...]:
        """One round trip: the next token, or with speculation the tokens a verify round keeps."""
        session = route.session
        assert session is not None
        transcript, stats = self._transcript, self._stats
        token, position = transcript.next_input()
        speculator = self._speculator
        draft: tuple[int, ...] = ()
        if (
            speculator is not None
            and stats.active <= self._options.speculation_max_generations
            and route.route is not None
            and all(hop.verifies_drafts for hop in route.route.hops)
        ):
            remaining = self._max_tokens - len(transcript.generated)
            draft = speculator.propose((*transcript.prompt, *transcript.generated), remaining - 1)
        self._watchdog.waiting()
        output = await session.decode(
            token,
            position=position,
            deadline_unix_ns=self._deadline_unix_ns(),
            draft=draft,
            rollback=self._rollback,
        )
        self._watchdog.answered()
        if not draft:
            tokens: tuple[int, ...] = (_token(output),)
            if speculator is not None:
                speculator.decoded_plainly()
        else:
            assert speculator is not None
            choices = output.tokens
            if len(choices) != len(draft) + 1:
                raise ShardProtocolError(
                    "the tail did not answer every position of a verify step",
                    code=shard.ERROR_CODE_INTERNAL,
                    retryable=True,
                )
            tokens = speculator.verified(draft, choices)
            stats.speculative_rounds += 1
            stats.draft_tokens += len(draft)
            stats.accepted_draft_tokens += len(tokens) - 1
        # Fewer drafts kept than sent: their positions are still in every hop's cache.
        self._rollback = len(tokens) - 1 < len(draft)
        if output.done.answered_directly:
            stats.direct_tokens += len(tokens)
        return tokens


async def _settle(handles: Sequence[UnitHandle], timeout_s: float) -> None:
    """Wait (a while at most) for the units to be answered; their outcomes are not wanted."""
    futures = [handle.future for handle in handles if not handle.future.done()]
    if futures:
        await asyncio.wait(futures, timeout=timeout_s)


def _kept_prompt_end(
    blocks: PrefixBlocks, prompt_tokens: int, start: int, chunk_tokens: int
) -> dict[int, bytes]:
    """The prompt's own digest, by its length, when its last chunk (prefilled from ``start`` in
    chunks of at most ``chunk_tokens``) carries it, so the hops keep the whole prompt: empty
    otherwise."""
    if not prompt_tokens % blocks.grid:
        return {}
    last = plan_prefill_chunks(
        prompt_tokens - start,
        first_position=start,
        max_prefill_chunk_tokens=chunk_tokens,
        grid=blocks.grid,
        min_rows=blocks.min_partial_rows,
    )[-1]
    digest = blocks.block_digest(last.first_position, last.token_count)
    return {prompt_tokens: digest} if digest else {}


def _token(output: StepOutput) -> int:
    token = output.token
    if token is None:
        raise ShardProtocolError(
            "the route ended without sampling a token", code=shard.ERROR_CODE_INTERNAL, retryable=True
        )
    return token


__all__ = ["RouteDecoder"]
