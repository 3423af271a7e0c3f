"""The generation driver: one request's tokens through a route of shards, surviving hop failures.

For each generation the driver plans a route from gossip
(:mod:`meshnode.head.route_choice`), opens one session to its first hop with the
other hops as its downstream (:mod:`meshnode.head.route_session`; on a route of more
than one hop the tail answers the head directly), prefills the prompt in pipelined
chunks and then decodes one token per step, speculatively where the request allows
(:mod:`meshnode.head.route_decoding`). The first hop may be this very node: the
environment hands out an in-process link for it, and the code path is the same.

Recovery (:mod:`meshnode.head.route_recovery`, deciding as :mod:`meshnode.head.recovery`
says): a ``CACHE_MISS`` rebuilds the caches under the same route session; any other
route failure finds the hops that are gone, excludes them, re-plans at the next epoch
and replays the session's tokens (:mod:`meshnode.head.transcript`) so that decoding
continues at the right position with the output an unbroken run would have produced.
A dead peer usually fails silently, so a watchdog (:mod:`meshnode.head.stall_watchdog`)
probes the route's hops when a unit stays unanswered for ``stall_probe_s`` and aborts
the session as soon as one of them is gone.

Hops may compute on different backends or weight layouts (their announced
numerics) within one hop contract. Such a route is used like any other; the
driver logs the mix and the token stream says how its route computes
(``system_fingerprint``, see :mod:`meshnode.head.numerics`).

Capacity (:mod:`meshnode.head.session_load`): routes avoid shards at capacity
while others exist, counting the sessions this head holds there even before
gossip reports them. A generation over the head's own limit of concurrent
generations fails with :class:`~meshnode.head.backend.MeshBusy` (the API's 429), as
does one that has produced nothing yet when every replica refused it for capacity;
one that has produced tokens waits for room instead (:mod:`meshnode.head.route_choice`).

Closing the token stream ends the generation everywhere: a unit still running is
cancelled on every hop, then the session is released (:mod:`meshnode.head.route_control`).

Prefix cache (:mod:`meshnode.head.prefix_index`, ``DriverConfig.prefix_cache``): a generation
that ends with its session released leaves its prompt's whole blocks kept at every hop, and the
driver remembers which route holds them; a later generation whose prompt starts the same way is
planned onto that route unless it is much busier (:mod:`meshnode.head.prefix_routes`) and
prefills only what follows the kept prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from engines.interface import SamplingParams
from meshnode.audit.commitment_store import CommitmentStore
from meshnode.audit.comparison import Conviction
from meshnode.audit.evidence import check_evidence
from meshnode.gen.meshnode.v1.audit_pb2 import AuditEvidence
from meshnode.head.answer_keeping import AnswerKeeper
from meshnode.head.auditor import Auditor, FinishedGeneration
from meshnode.head.backend import GenerationFailed, MeshBusy
from meshnode.head.driver_config import DriverConfig
from meshnode.head.driver_stats import DriverStats
from meshnode.head.planner import ModelIdentity, NoRouteError, Route, plan_route_with_room
from meshnode.head.prefix_index import PrefixIndex
from meshnode.head.prefix_routes import preferred_route
from meshnode.head.recovery import ROUTE_FAILURES
from meshnode.head.route_choice import RouteChoice
from meshnode.head.route_control import CancelReport, RouteControl
from meshnode.head.route_decoding import RouteDecoder
from meshnode.head.route_environment import RouteEnvironment
from meshnode.head.route_recovery import RouteRecovery
from meshnode.head.route_session import RouteSession
from meshnode.head.session_load import SessionLedger
from meshnode.head.stall_watchdog import StallWatchdog
from meshnode.head.transcript import Transcript
from meshnode.identity import short_id
from meshnode.sansio import SECOND_NS
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


class TokenObserver(Protocol):
    """Told of each token a generation yields: ``first``, and the seconds since the generation
    started (its first token) or since its previous token (the rest). /metrics' latency histograms."""

    def __call__(self, first: bool, seconds: float) -> None: ...


class GenerationDriver:
    def __init__(
        self,
        env: RouteEnvironment,
        options: DriverConfig | None = None,
        *,
        audit_rng: random.Random | None = None,
    ) -> None:
        """``audit_rng``: draws which generations are audited and on which replicas (seeded in tests)."""
        self.env = env
        self.options = options or DriverConfig()
        self.stats = DriverStats()
        self._background: set[asyncio.Task[Any]] = set()
        self.token_observers: list[TokenObserver] = []
        # Node id -> monotonic ns until which it stays out of new routes.
        self._found_dead: dict[bytes, int] = {}
        # The sessions this head's generations hold, per shard.
        self.sessions = SessionLedger()
        # Which routes hold which prompt prefixes (None: the prefix cache is off).
        self.prefixes = PrefixIndex(self.options.boundary_dtype) if self.options.prefix_cache else None
        # Prefills finished generations' answers after their kept prompts (None: not asked to).
        self.answers: AnswerKeeper | None = None
        if self.prefixes is not None and self.options.keep_answers:
            self.answers = AnswerKeeper(
                env, self.options, self.sessions, self.prefixes, self.spawn, self.stats
            )
        # The commitments the hops of this head's generations signed, for audits (bounded).
        self.commitments = CommitmentStore()
        # Nodes an audit convicted, with the evidence: no route of this head goes through them.
        self.convicted: dict[bytes, AuditEvidence] = {}
        # Told of each conviction (a node's head hands the evidence to gossip).
        self.conviction_listeners: list[Callable[[Conviction], None]] = []
        self.auditor = Auditor(
            env,
            self.options,
            self.commitments,
            self._convict,
            excluded=lambda: frozenset(self.convicted),
            rng=audit_rng,
        )

    def generate(
        self, model: ModelIdentity, prompt: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> GenerationStream:
        """At most ``max_tokens`` sampled token ids; fewer when the route's context is full.
        Raises :class:`~meshnode.head.backend.GenerationFailed` when no route can serve it."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        return GenerationStream(_Generation(self, model, Transcript(tuple(prompt)), sampling, max_tokens))

    def plan(self, model: ModelIdentity, exclude: set[bytes], prompt: Sequence[int] = ()) -> Route:
        """The cheapest route avoiding ``exclude`` and, when possible, hops found dead lately; or,
        not much busier, the route holding the longest prefix of ``prompt``."""
        now_ns = time.monotonic_ns()
        self._found_dead = {node: until for node, until in self._found_dead.items() if until > now_ns}
        candidates = self.sessions.adjust(
            [c for c in self.env.candidates() if c.node_id not in self.convicted]
        )
        avoid = frozenset(exclude)
        route = None
        if self._found_dead:
            with contextlib.suppress(NoRouteError):
                dead = frozenset(exclude | self._found_dead.keys())
                route = plan_route_with_room(candidates, model, exclude=dead)
                avoid = dead
        if route is None:
            route = plan_route_with_room(candidates, model, exclude=avoid)
        if self.prefixes is None or not prompt:
            return route
        preferred = preferred_route(route, self.prefixes.holders(model, prompt), candidates, avoid)
        if preferred is None:
            return route
        self.stats.prefix_route_preferred += 1
        log.debug("a route holding the prompt's first %d tokens is preferred to the cheapest", preferred[1])
        return preferred[0]

    def _convict(self, conviction: Conviction) -> None:
        """An audit convicted a node: new routes avoid it from now on."""
        self.convicted[conviction.accused] = conviction.evidence
        log.warning(
            "node %s is convicted of computing wrong by an audit and no longer routed through (%s)",
            short_id(conviction.accused),
            check_evidence(conviction.evidence).detail,
        )
        for listener in self.conviction_listeners:
            listener(conviction)

    def found_dead(self, node_ids: set[bytes]) -> None:
        until_ns = time.monotonic_ns() + round(self.options.dead_memory_s * SECOND_NS)
        for node_id in node_ids:
            self._found_dead[node_id] = until_ns

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` to completion even if whoever started it goes away."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def aclose(self) -> None:
        """Wait for the cleanups still running (cancels and releases of finished generations); audits
        still running or waiting are abandoned."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.auditor.aclose()


class _Generation:
    """One generation's token stream, composed of the parts that each own a piece of its state: the
    route's session (:class:`RouteSession`), which route comes next (:class:`RouteChoice`), the stall
    watchdog, the decoder (replay, decode, speculation) and the recovery from route failures."""

    def __init__(
        self,
        driver: GenerationDriver,
        model: ModelIdentity,
        transcript: Transcript,
        sampling: SamplingParams,
        max_tokens: int,
    ) -> None:
        env, options, stats = driver.env, driver.options, driver.stats
        self._driver = driver
        self._options = options
        self._stats = stats
        self._transcript = transcript
        self._max_tokens = max_tokens
        self._session_id = uuid.uuid4().hex
        self._sampling = sampling
        self._route = RouteSession(
            env,
            options,
            stats,
            driver.sessions,
            model,
            sampling,
            self._session_id,
            driver.commitments,
            journals=options.audit_rate > 0,
        )
        self._choice = RouteChoice(driver, options, model, transcript)
        self._watchdog = StallWatchdog(env, options, self._route)
        self._decoder = RouteDecoder(
            options, stats, transcript, sampling, max_tokens, self._watchdog, driver.prefixes
        )
        self._control = RouteControl(env, options, self._session_id)
        self._recovery = RouteRecovery(
            driver, env, options, stats, self._route, self._choice, self._watchdog, self._control
        )
        # Monotonic ns for the token observers: the start, and the last token yielded.
        self._started_at_ns = time.monotonic_ns()
        self._last_token_at_ns: int | None = None

    @property
    def route(self) -> Route | None:
        return self._route.route

    @property
    def system_fingerprint(self) -> str | None:
        return self._route.system_fingerprint

    @property
    def cached_tokens(self) -> int:
        return self._decoder.cached_tokens

    # ------------------------------------------------------------------ the token stream

    async def run(self) -> AsyncGenerator[int, None]:
        stats, transcript = self._stats, self._transcript
        if stats.active >= self._options.max_generations:
            stats.busy += 1
            raise MeshBusy(
                f"this node already runs {stats.active} generations, its limit",
                retry_after_s=self._options.busy_retry_after_s,
            )
        stats.started += 1
        stats.prompt_tokens += len(transcript.prompt)
        stats.active += 1
        outcome = "failed"
        watchdog = asyncio.ensure_future(self._watchdog.run())
        synced = False
        try:
            if self._driver.answers is not None:
                # A keep of this prompt's previous answer holds what it would start from.
                await self._driver.answers.wait_for(transcript.prompt)
            while True:
                try:
                    if self._route.session is None:
                        await self._open_route()
                        synced = False
                    if not synced:
                        first = await self._decoder.replay(self._route)
                        synced = True
                        if first is not None:
                            transcript.record(first)
                            self._count_token()
                            yield first
                    while len(transcript.generated) < self._max_tokens:
                        for token in await self._decoder.decode(self._route):
                            transcript.record(token)
                            self._count_token()
                            yield token
                    break
                except GenerationFailed:
                    raise
                except ROUTE_FAILURES as error:
                    refusers = self._route.capacity_refusers(error)
                    if refusers:
                        self._recovery.refused_for_capacity(refusers, error)
                        synced = False
                        continue
                    if self._context_full(error):
                        # A verify round reaches past the position a plain decode needs: the
                        # rest goes token by token, from caches rebuilt without the drafts.
                        if self._decoder.stop_speculating():
                            synced = False
                            continue
                        log.info("generation %s: the context is full", self._session_id[:8])
                        break
                    await self._recovery.recover(error)
                    synced = False
            outcome = "completed"
        except MeshBusy:
            outcome = "busy"
            raise
        except GeneratorExit:
            outcome = "cancelled" if self._watchdog.interrupted else "closed"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            watchdog.cancel()
            cleanup = self._driver.spawn(self._end(outcome, interrupted=self._watchdog.interrupted))
            # Shielded: a consumer cancelled again meanwhile leaves the cleanup running.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)

    def _count_token(self) -> None:
        self._stats.tokens += 1
        now_ns = time.monotonic_ns()
        since_ns = self._started_at_ns if self._last_token_at_ns is None else self._last_token_at_ns
        for observe in self._driver.token_observers:
            observe(self._last_token_at_ns is None, (now_ns - since_ns) / SECOND_NS)
        self._last_token_at_ns = now_ns

    async def _open_route(self) -> None:
        self._route.next_epoch()
        route = await self._choice.plan()
        self._watchdog.new_route()
        await self._route.open(route)
        self._choice.opened()

    def _context_full(self, error: BaseException) -> bool:
        """A step past a session's context once tokens were generated ends the generation normally."""
        return (
            isinstance(error, ShardProtocolError)
            and error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
            and not error.retryable
            and self._transcript.started
        )

    # ------------------------------------------------------------------ the end

    async def _end(self, outcome: str, *, interrupted: bool) -> None:
        """Cancel and release what the generation holds, then count it as over."""
        try:
            route, epoch = self._route.route, self._route.epoch
            session = self._route.take_for_end()
            if session is not None and route is not None:
                report = await self._control.end(session, route.hops, epoch, interrupted=interrupted)
                if report is not None:
                    self._stats.last_cancel = report
                if not interrupted and outcome in ("completed", "closed"):
                    self._remember_prefix(route)
                journal = self._route.journal
                if outcome == "completed" and journal is not None:
                    self._driver.auditor.finished(
                        FinishedGeneration(self._session_id, epoch, route, journal, self._sampling)
                    )
        finally:
            self._route.release_hold()
            self._stats.active -= 1
            setattr(self._stats, outcome, getattr(self._stats, outcome) + 1)

    def _remember_prefix(self, route: Route) -> None:
        """The session was released on ``route``: its hops keep the prompt's whole blocks (and its
        partial last one where they can), and the answer is kept after it in the background."""
        prefixes, prefilled = self._driver.prefixes, self._decoder.prefilled
        if prefixes is not None and prefilled is not None and prefilled.route == route:
            prefixes.record(route, prefilled.grid, prefilled.digests, prefilled.partial)
            answers = self._driver.answers
            if answers is not None and (prefilled.digests or prefilled.partial):
                answers.keep(route.model, route, self._transcript.prompt, self._transcript.generated)


class GenerationStream:
    """One generation's token ids, and how the route producing them computes.

    An async iterator like the generator it wraps (closing it ends the generation
    everywhere); ``system_fingerprint`` follows the route, so after a re-route it
    describes the new one."""

    def __init__(self, generation: _Generation) -> None:
        self._generation = generation
        self._tokens: AsyncGenerator[int, None] = generation.run()

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    @property
    def route(self) -> Route | None:
        return self._generation.route

    @property
    def system_fingerprint(self) -> str | None:
        return self._generation.system_fingerprint

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the route did not prefill again: the hops started from a prefix they kept
        (the API's ``usage.prompt_tokens_details.cached_tokens``)."""
        return self._generation.cached_tokens


__all__ = [
    "CancelReport",
    "DriverConfig",
    "DriverStats",
    "GenerationDriver",
    "GenerationStream",
    "RouteEnvironment",
]
