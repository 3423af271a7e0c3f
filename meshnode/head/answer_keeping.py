"""A finished generation's answer, prefilled after its kept prompt so the hops keep it too.

A chat client resends every answer with its next message. The positions an answer's decode steps
wrote are never kept (a one-row pass rounds otherwise than a prefill's: engines.row_invariance),
so the next turn would prefill the answer again before its first token, on top of its own new
message. Instead, once a generation is over and its hops kept its prompt
(meshnode.head.prefix_index), :class:`AnswerKeeper` opens one more session on the same route, starting from that kept prompt,
prefills the answer after it as one more prompt and releases it: the hops then keep prompt and
answer as a fresh prefill computes them, and the next turn starts after both.

It runs in the background after the answer was delivered, only on a route whose hops keep partial
blocks (the answer rarely ends on the grid), for an answer of a pass's worth of rows
(``MIN_SIZE_FREE_PASS_ROWS``), and where every hop has a session to spare besides the keep's (a
keep never takes a client's session). A request that starts with that prompt while it runs (the next
turn, or the same prompt again) waits for it, at most ``DriverConfig.keep_answer_wait_s``: the
keep has taken over the kept prompt that request would start from, and a next turn would
prefill the same answer itself. It never prefills from position 0 (a hop that no longer keeps
the prompt ends it), and whatever fails leaves the prompt kept as it was. Tokens an answer has
past what its client saw (a stop string), or that the client resends as other tokens, cost their
prefill and nothing else: the next prompt's digests stop matching there, and the kept prompt
before them is still found.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from engines.interface import GREEDY, MIN_SIZE_FREE_PASS_ROWS
from meshnode.head.driver_config import DriverConfig
from meshnode.head.driver_stats import DriverStats
from meshnode.head.planner import ModelIdentity, Route
from meshnode.head.prefix_index import PrefixIndex
from meshnode.head.recovery import ROUTE_FAILURES
from meshnode.head.route_control import RouteControl
from meshnode.head.route_decoding import RouteDecoder
from meshnode.head.route_environment import RouteEnvironment
from meshnode.head.route_session import RouteSession
from meshnode.head.session_load import SessionLedger
from meshnode.head.stall_watchdog import StallWatchdog
from meshnode.head.transcript import Transcript

log = logging.getLogger(__name__)

# Sessions a hop must have free for a keep to start there: the keep's, and one for a client.
FREE_SESSIONS_FOR_A_KEEP = 2
# What ends a keep early: a route failure, or a hop that no longer keeps the prompt.
_GIVEN_UP: tuple[type[BaseException], ...] = (*ROUTE_FAILURES, LookupError)


class AnswerKeeper:
    def __init__(
        self,
        env: RouteEnvironment,
        options: DriverConfig,
        ledger: SessionLedger,
        prefixes: PrefixIndex,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        counters: DriverStats,
    ) -> None:
        """``counters``: the head's, where keeps are counted (``answers_kept`` and the rest)."""
        self._env = env
        self._options = options
        self._ledger = ledger
        self._prefixes = prefixes
        self._spawn = spawn
        self._counters = counters
        # The prompt each running keep prefills an answer after.
        self._running: dict[asyncio.Task[None], tuple[int, ...]] = {}

    def keep(self, model: ModelIdentity, route: Route, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Start keeping ``answer`` after ``prompt``, which ``route``'s hops were just left keeping
        (some of it: the caller knows they kept a block of it)."""
        if len(answer) < MIN_SIZE_FREE_PASS_ROWS or not route.keeps_partial_blocks:
            return
        task = self._spawn(self._keep(model, route, (*prompt, *answer)))
        self._running[task] = tuple(prompt)
        task.add_done_callback(lambda done: self._running.pop(done, None))

    async def wait_for(self, prompt: Sequence[int]) -> None:
        """Wait (bounded) for the keeps running after a prefix of ``prompt``. Such a keep holds
        the kept prefix this prompt would start from (it took it over), so starting now would find
        it gone; once it ends, the prompt starts after the kept answer, or where it differs from it
        (a client resending the answer as other tokens), after the kept prompt."""
        waiting = [
            task
            for task, kept_prompt in self._running.items()
            if len(kept_prompt) <= len(prompt) and tuple(prompt[: len(kept_prompt)]) == kept_prompt
        ]
        if waiting:
            self._counters.answer_waits += 1
            await asyncio.wait(waiting, timeout=self._options.keep_answer_wait_s)

    def _has_room(self, route: Route) -> bool:
        """Whether every hop of ``route`` has a session to spare besides the keep's, as this head
        sees their load (gossip, and the sessions it holds there): a keep never takes a client's."""
        candidates = self._ledger.adjust(self._env.candidates())
        for hop in route.hops:
            serving = [
                c
                for c in candidates
                if (c.node_id, c.start_layer, c.end_layer) == (hop.node_id, hop.start_layer, hop.end_layer)
            ]
            if not serving or not serving[0].accepting:
                return False
            if (
                serving[0].max_sessions
                and serving[0].active_sessions + FREE_SESSIONS_FOR_A_KEEP > serving[0].max_sessions
            ):
                return False
        return True

    async def _keep(self, model: ModelIdentity, route: Route, tokens: tuple[int, ...]) -> None:
        if not self._has_room(route):
            self._counters.answers_not_kept += 1
            log.debug("an answer was not kept after its prompt: its route has no session to spare")
            return
        session_id = uuid.uuid4().hex
        # Its own counters: a keep is no generation, and no prefix hit a client asked for.
        stats = DriverStats()
        route_session = RouteSession(
            self._env, self._options, stats, self._ledger, model, GREEDY, session_id, background=True
        )
        route_session.next_epoch()
        control = RouteControl(self._env, self._options, session_id)
        transcript = Transcript(tokens)
        watchdog = StallWatchdog(self._env, self._options, route_session)
        decoder = RouteDecoder(self._options, stats, transcript, GREEDY, 1, watchdog, self._prefixes)
        try:
            await route_session.open(route)
            await decoder.replay(route_session, only_after_prefix=True)
        except _GIVEN_UP as error:
            self._counters.answers_not_kept += 1
            log.info("an answer of %d tokens was not kept after its prompt: %s", len(tokens), error)
            route_session.drop()
            await control.release_quietly(route.hops, route_session.epoch)
            return
        session = route_session.take_for_end()
        try:
            if session is not None:
                await control.end(session, route.hops, route_session.epoch, interrupted=False)
        finally:
            route_session.release_hold()
        prefilled = decoder.prefilled
        if prefilled is not None:
            self._prefixes.record(route, prefilled.grid, prefilled.digests, prefilled.partial)
        self._counters.answers_kept += 1
        self._counters.answer_tokens_kept += len(tokens) - decoder.cached_tokens
        log.debug(
            "kept an answer: %d tokens prefilled after the %d kept",
            len(tokens) - decoder.cached_tokens,
            decoder.cached_tokens,
        )


__all__ = ["AnswerKeeper"]
