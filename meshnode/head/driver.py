"""The generation driver: one request's tokens through a route of shards, surviving hop failures.

For each generation the driver plans a route from gossip, opens one
:class:`~meshnode.dataplane.session_link.ShardSession` to the first hop with the
other hops as its downstream (activations flow shard to shard; only the tail's
sampled token comes back), prefills the prompt in pipelined chunks and then
decodes one token per step. On a route of more than one hop the token comes
back directly: the session opens an answer stream to the tail (over the head's
own link to it), so a token costs one message back instead of one per stage
(``DriverOptions.direct_answer``); acknowledgements still come hop by hop. The first hop may be this very node: the
environment hands out an in-process link for it, and the code path is the same.

Speculative decoding (:mod:`meshnode.head.speculation`, ``DriverOptions.speculation``): for
a greedy or seeded sampled request the head drafts tokens by prompt lookup and sends them
with its last token as one verify step; the tail's choice after every position says how
many to keep, 1 to k + 1 tokens a round trip, the very tokens plain decoding gives. The next
step asks every hop to drop the rejected drafts (``rollback``). Only accepted tokens enter
the transcript, so a replay after a failure rebuilds exactly the accepted caches.
Penalised and grammar requests decode one token at a time, as do routes with a hop
that does not announce verify steps (``ServedShard.verifies_drafts``: a node predating them).

Recovery follows :mod:`meshnode.head.recovery`: a ``CACHE_MISS`` rebuilds the
caches under the same route session; any other route failure finds the hops
that are gone, excludes them, re-plans at the next epoch and replays the
session's tokens (:mod:`meshnode.head.transcript`) so that decoding continues
at the right position with the output an unbroken run would have produced. A
dead peer usually fails silently (its QUIC link does not notice for a long
time), so a watchdog probes the route's hops when a unit stays unanswered for
``stall_probe_s`` and aborts the session as soon as one of them is gone.

Hops may compute on different backends or weight layouts (their announced
numerics) within one hop contract. Such a route is used like any other; the
driver logs the mix and the token stream says how its route computes
(``system_fingerprint``, see :mod:`meshnode.head.numerics`).

Capacity (:mod:`meshnode.head.session_load`): routes avoid shards at capacity
while others exist, counting the sessions this head holds there even before
gossip reports them. A shard that refuses a new session for capacity
(RESOURCE_EXHAUSTED, retryable, before the session's first result) is left out
of this generation's routes and the next replica tried; when none is left,
a generation that has produced nothing yet fails with
:class:`~meshnode.head.backend.MeshBusy` (the API's 429), as does one over the
head's own limit of concurrent generations. One that has produced tokens is
never dropped for capacity: it waits for room, up to ``capacity_wait_s``.

Closing the token stream ends the generation everywhere: when a unit is still
running, the session's out-of-band Cancel goes to the first hop (which passes it
on) and a unary Cancel goes to every other hop directly, so a chain wedged
between two hops still stops; then the session is released, in band and with a
unary Release to every hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from engines.interface import SamplingParams, supports_speculation
from meshnode.dataplane import rpc
from meshnode.dataplane.envelope import HIGHEST_SCHEMA_VERSION
from meshnode.dataplane.route import make_hop
from meshnode.dataplane.session_link import (
    DirectAnswers,
    SessionOptions,
    ShardSession,
    StepOutput,
    default_client_config,
)
from meshnode.head.backend import ContextLengthExceeded, GenerationFailed, MeshBusy
from meshnode.head.candidates import session_fingerprint
from meshnode.head.driver_options import DriverOptions
from meshnode.head.numerics import describe_numerics, mixes_numerics, system_fingerprint
from meshnode.head.pipeline import pipeline_stages
from meshnode.head.planner import (
    Hop,
    ModelIdentity,
    NoRouteError,
    Route,
    ShardCandidate,
    plan_route_with_room,
)
from meshnode.head.recovery import ROUTE_FAILURES, Recovery, RecoveryPolicy, describe
from meshnode.head.session_load import SessionLedger
from meshnode.head.speculation import SpeculationConfig, Speculator
from meshnode.head.transcript import Transcript
from meshnode.identity import short_id
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import PeerLink
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


class RouteEnvironment(Protocol):
    """What the driver needs from the mesh (a :class:`~meshnode.node.Node`, or a single local shard)."""

    def candidates(self) -> list[ShardCandidate]:
        """Every shard gossip currently offers, this node's own included."""
        ...

    async def link(self, node_id: bytes) -> PeerLink:
        """A link to the hop (an in-process one for this node itself)."""
        ...

    async def alive(self, node_id: bytes, probe_timeout: float) -> bool:
        """Whether the peer answers a liveness probe waiting ``probe_timeout`` at most.

        A mesh node may probe twice (once more around a relay that stopped answering).
        """
        ...


@dataclass(frozen=True)
class CancelReport:
    """How the end of an interrupted generation reached its route."""

    route_session_id: str
    route_epoch: int
    hops: tuple[str, ...]
    # Hops that answered the unary Cancel (the first hop through the session's own Cancel).
    cancel_acknowledged: tuple[str, ...]
    # Hops that answered the unary Release.
    release_acknowledged: tuple[str, ...]


class TokenObserver(Protocol):
    """Told of each token a generation yields: ``first``, and the seconds since the generation
    started (its first token) or since its previous token (the rest). /metrics' latency histograms."""

    def __call__(self, first: bool, seconds: float) -> None: ...


@dataclass
class DriverStats:
    started: int = 0
    active: int = 0
    completed: int = 0
    # Closed by the consumer while a unit was running: cancelled on every hop.
    cancelled: int = 0
    # Closed by the consumer between tokens (it had what it wanted).
    closed: int = 0
    failed: int = 0
    # Refused before they started: every route at capacity, or the head at its limit.
    busy: int = 0
    # New sessions a shard refused for capacity (each sent the generation to another replica).
    capacity_refusals: int = 0
    tokens: int = 0
    # Prompt tokens of the generations started.
    prompt_tokens: int = 0
    # Tokens that came straight from the tail on its answer stream (the rest came along the route).
    direct_tokens: int = 0
    # Speculative decoding: verify rounds sent, draft tokens in them, drafts the tail accepted.
    speculative_rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    rebuilds: int = 0
    reroutes: int = 0
    # Routes opened (every epoch of every generation) by how their stages run: in pipeline
    # cohorts, or every session in one batch a stage; and the last one's cohorts (0: one batch).
    routes_in_cohorts: int = 0
    routes_in_one_batch: int = 0
    last_route_cohorts: int = 0
    replay_mismatches: int = 0
    last_route: tuple[str, ...] = ()
    # Per hop of last_route: how it computes (its announced numerics).
    last_route_numerics: tuple[str, ...] = ()
    last_system_fingerprint: str = ""
    last_cancel: CancelReport | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class GenerationDriver:
    def __init__(self, env: RouteEnvironment, options: DriverOptions | None = None) -> None:
        self.env = env
        self.options = options or DriverOptions()
        self.stats = DriverStats()
        self._background: set[asyncio.Task[Any]] = set()
        self.token_observers: list[TokenObserver] = []
        # Node id -> monotonic time until which it stays out of new routes.
        self._found_dead: dict[bytes, float] = {}
        # The sessions this head's generations hold, per shard.
        self.sessions = SessionLedger()

    def generate(
        self, model: ModelIdentity, prompt: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> GenerationStream:
        """At most ``max_tokens`` sampled token ids; fewer when the route's context is full.
        Raises :class:`~meshnode.head.backend.GenerationFailed` when no route can serve it."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        return GenerationStream(_Generation(self, model, Transcript(tuple(prompt)), sampling, max_tokens))

    def plan(self, model: ModelIdentity, exclude: set[bytes]) -> Route:
        """The cheapest route avoiding ``exclude`` and, when possible, hops found dead lately."""
        now = time.monotonic()
        self._found_dead = {node: until for node, until in self._found_dead.items() if until > now}
        candidates = self.sessions.adjust(self.env.candidates())
        if self._found_dead:
            with contextlib.suppress(NoRouteError):
                dead = frozenset(exclude | self._found_dead.keys())
                return plan_route_with_room(candidates, model, exclude=dead)
        return plan_route_with_room(candidates, model, exclude=frozenset(exclude))

    def found_dead(self, node_ids: set[bytes]) -> None:
        until = time.monotonic() + self.options.dead_memory_s
        for node_id in node_ids:
            self._found_dead[node_id] = until

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` to completion even if whoever started it goes away."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def aclose(self) -> None:
        """Wait for the cleanups still running (cancels and releases of finished generations)."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


class _Generation:
    def __init__(
        self,
        driver: GenerationDriver,
        model: ModelIdentity,
        transcript: Transcript,
        sampling: SamplingParams,
        max_tokens: int,
    ) -> None:
        self.driver = driver
        self.env = driver.env
        self.options = driver.options
        self.stats = driver.stats
        self.model = model
        self.transcript = transcript
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.session_id = uuid.uuid4().hex
        self.policy = RecoveryPolicy(self.options.budget)
        self.epoch = 0
        self.route: Route | None = None
        self.session: ShardSession | None = None
        self.excluded: set[bytes] = set()
        # Shards that refused this generation a session for capacity: out of its routes until no
        # route is left without them.
        self.busy: set[bytes] = set()
        # Monotonic time until which a started generation waits for room (None: not waiting).
        self.room_deadline: float | None = None
        # The hops of the session open now, as counted in the driver's ledger.
        self.held: tuple[bytes, ...] = ()
        # Where the current epoch's session is: the first hop accepted it (opened), and every hop
        # did (admitted, once the first unit came back).
        self.opened = False
        self.admitted = False
        # Hops of the current route the watchdog found gone.
        self.found_dead: set[bytes] = set()
        # Monotonic time the unit now awaited was sent; None between units. Left set when the
        # wait ends in an exception, so the end of the generation knows work was interrupted.
        self.waiting_since: float | None = None
        # Monotonic times for the token observers: the start, and the last token yielded.
        self.started_at = time.monotonic()
        self.last_token_at: float | None = None
        # Speculative decoding, for a greedy or seeded sampled request when the options allow it.
        self.speculator: Speculator | None = None
        if self.options.speculation and supports_speculation(sampling):
            draft_max = self.options.draft_max
            self.speculator = Speculator(
                SpeculationConfig(max_draft=draft_max, initial_draft=min(4, draft_max))
            )
        # The route's caches may hold rejected drafts of the last verify round beyond the accepted
        # tokens: the next step asks every hop to drop them.
        self.rollback = False
        self._fingerprinted_route: Route | None = None
        self._fingerprint: str | None = None

    @property
    def system_fingerprint(self) -> str | None:
        """How the current route computes; None before one is planned. Computed once per route:
        the API asks for it with every token, and it is a JSON digest."""
        route = self.route
        if route is None:
            return None
        if self._fingerprinted_route is not route:
            self._fingerprint = system_fingerprint(route, self.options.boundary_dtype)
            self._fingerprinted_route = route
        return self._fingerprint

    # ------------------------------------------------------------------ the token stream

    async def run(self) -> AsyncGenerator[int, None]:
        if self.stats.active >= self.options.max_generations:
            self.stats.busy += 1
            raise MeshBusy(
                f"this node already runs {self.stats.active} generations, its limit",
                retry_after_s=self.options.busy_retry_after_s,
            )
        self.stats.started += 1
        self.stats.prompt_tokens += len(self.transcript.prompt)
        self.stats.active += 1
        outcome = "failed"
        watchdog = asyncio.ensure_future(self._watch())
        synced = False
        try:
            while True:
                try:
                    if self.session is None:
                        await self._open_route()
                        synced = False
                    if not synced:
                        first = await self._replay()
                        synced = True
                        if first is not None:
                            self.transcript.record(first)
                            self._count_token()
                            yield first
                    while len(self.transcript.generated) < self.max_tokens:
                        for token in await self._decode():
                            self.transcript.record(token)
                            self._count_token()
                            yield token
                    break
                except GenerationFailed:
                    raise
                except ROUTE_FAILURES as error:
                    refusers = self._capacity_refusers(error)
                    if refusers:
                        self._refused_for_capacity(refusers, error)
                        synced = False
                        continue
                    if self._context_full(error):
                        if self.speculator is not None:
                            # A verify round reaches past the position a plain decode needs: the
                            # rest goes token by token, from caches rebuilt without the drafts.
                            self.speculator = None
                            synced = False
                            continue
                        log.info("generation %s: the context is full", self.session_id[:8])
                        break
                    await self._recover(error)
                    synced = False
            outcome = "completed"
        except MeshBusy:
            outcome = "busy"
            raise
        except GeneratorExit:
            outcome = "cancelled" if self.waiting_since is not None else "closed"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            watchdog.cancel()
            cleanup = self.driver.spawn(self._end(outcome, interrupted=self.waiting_since is not None))
            # Shielded: a consumer cancelled again meanwhile leaves the cleanup running.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)

    def _count_token(self) -> None:
        self.stats.tokens += 1
        now = time.monotonic()
        since = self.started_at if self.last_token_at is None else self.last_token_at
        for observe in self.driver.token_observers:
            observe(self.last_token_at is None, now - since)
        self.last_token_at = now

    async def _plan(self) -> Route:
        """The next route: around dead hops and hops that refused for capacity; with none left
        but for those, MeshBusy before the first token, or a wait for room after it."""
        while True:
            try:
                return self.driver.plan(self.model, self.excluded | self.busy)
            except NoRouteError as exc:
                if not self.busy:
                    raise GenerationFailed(str(exc)) from None
                if not self.transcript.started:
                    raise MeshBusy(
                        f"every route's shards are at capacity ({len(self.busy)} refused a new session); "
                        "retry shortly",
                        retry_after_s=self.options.busy_retry_after_s,
                    ) from None
            now = time.monotonic()
            if self.room_deadline is None:
                self.room_deadline = now + self.options.capacity_wait_s
            if now >= self.room_deadline:
                raise GenerationFailed(
                    f"no shard had room to continue the generation within {self.options.capacity_wait_s:g} s"
                )
            await asyncio.sleep(self.options.capacity_retry_s)
            # Sessions end all the time: every replica may be asked again.
            self.busy.clear()

    async def _open_route(self) -> None:
        self.epoch += 1
        self.opened = self.admitted = False
        route = await self._plan()
        self.route = route
        self.found_dead = set()
        self.stats.last_route = tuple(short_id(hop.node_id) for hop in route.hops)
        self.stats.last_route_numerics = tuple(hop.numerics for hop in route.hops)
        self.stats.last_system_fingerprint = self.system_fingerprint or ""
        if mixes_numerics(route):
            log.info(
                "generation %s epoch %d: the route mixes numerics (%s); its numbers may differ "
                "slightly from a run on one configuration",
                self.session_id[:8],
                self.epoch,
                describe_numerics(route),
            )
        first = route.hops[0]
        link_to_first = first.node_id
        stages = pipeline_stages(self.options.pipeline, route.hops, self.options.pipeline_cohorts)
        self.stats.last_route_cohorts = stages
        if stages:
            self.stats.routes_in_cohorts += 1
        else:
            self.stats.routes_in_one_batch += 1
        log.debug(
            "generation %s epoch %d: route %s, %s",
            self.session_id[:8],
            self.epoch,
            " -> ".join(_hop_text(hop) for hop in route.hops),
            f"its stages kept busy in {stages} cohorts" if stages else "its sessions in one batch a stage",
        )
        tail = route.hops[-1]
        answers = None
        if self.options.direct_answer and len(route.hops) > 1:
            link_to_tail = tail.node_id
            answers = DirectAnswers(
                links=lambda: self.env.link(link_to_tail),
                tail_range=shard.ShardRange(
                    start_layer=tail.start_layer,
                    end_layer=tail.end_layer,
                    effective_start_layer=tail.effective_start_layer,
                ),
            )
        self.session = await ShardSession.open(
            lambda: self.env.link(link_to_first),
            fingerprint=session_fingerprint(self.model),
            shard_range=shard.ShardRange(
                start_layer=first.start_layer,
                end_layer=first.end_layer,
                effective_start_layer=first.effective_start_layer,
            ),
            downstream=[
                make_hop(hop.node_id, hop.start_layer, hop.end_layer, hop.effective_start_layer)
                for hop in route.hops[1:]
            ],
            sampling=self.sampling,
            boundary_dtype=self.options.boundary_dtype,
            pipeline_stages=stages,
            route_session_id=self.session_id,
            route_epoch=self.epoch,
            config=default_client_config(),
            options=SessionOptions(open_timeout_s=self.options.open_timeout_s),
            answers=answers,
        )
        self.opened = True
        self.room_deadline = None
        self.held = route.node_ids
        self.driver.sessions.hold(self.held)

    def _deadline(self, queued: int = 0) -> int:
        allowance = self.options.unit_timeout_s + queued * self.options.queued_unit_allowance_s
        return time.time_ns() + int(allowance * SECOND_NS)

    async def _replay(self) -> int | None:
        """(Re)build the route's caches from the transcript. Before the first token this is the
        prompt's prefill and returns the first token; later it returns None."""
        session = self.session
        assert session is not None
        # Rebuilt from the transcript: nothing but accepted tokens (a fresh prefill at position 0).
        self.rollback = False
        prefill = session.submit_prefill(self.transcript.prompt, deadline_ns=self._deadline())
        steps = self.transcript.replay_steps()
        decodes = [
            session.submit_decode(step.token, position=step.position, deadline_ns=self._deadline(index + 1))
            for index, step in enumerate(steps, start=len(prefill))
        ]
        self.waiting_since = time.monotonic()
        output: StepOutput | None = None
        for handle in prefill:
            output = await handle
            self.admitted = True
            self.waiting_since = time.monotonic()
        assert output is not None
        first = _token(output)
        if self.transcript.started:
            self._check_replay(first, self.transcript.generated[0], len(self.transcript.prompt))
            for step, handle in zip(steps, decodes, strict=True):
                self._check_replay(_token(await handle), step.expected, step.position + 1)
                self.waiting_since = time.monotonic()
            if steps:
                log.info(
                    "generation %s: replayed %d tokens on the new route",
                    self.session_id[:8],
                    len(self.transcript.prompt) + len(steps),
                )
            first = None
        self.waiting_since = None
        return first

    def _check_replay(self, sampled: int, expected: int, position: int) -> None:
        if sampled != expected:
            self.stats.replay_mismatches += 1
            log.warning(
                "generation %s: the replay sampled %d at position %d where the original run sampled %d "
                "(the new route computes differently); keeping the original",
                self.session_id[:8],
                sampled,
                position,
                expected,
            )

    async def _decode(self) -> tuple[int, ...]:
        """One round trip: the next token, or with speculation the tokens a verify round keeps."""
        session = self.session
        assert session is not None
        token, position = self.transcript.next_input()
        speculator = self.speculator
        draft: tuple[int, ...] = ()
        if (
            speculator is not None
            and self.stats.active <= self.options.speculation_max_generations
            and self.route is not None
            and all(hop.verifies_drafts for hop in self.route.hops)
        ):
            transcript = self.transcript
            remaining = self.max_tokens - len(transcript.generated)
            draft = speculator.propose((*transcript.prompt, *transcript.generated), remaining - 1)
        self.waiting_since = time.monotonic()
        output = await session.decode(
            token, position=position, deadline_ns=self._deadline(), draft=draft, rollback=self.rollback
        )
        self.waiting_since = None
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
            self.stats.speculative_rounds += 1
            self.stats.draft_tokens += len(draft)
            self.stats.accepted_draft_tokens += len(tokens) - 1
        # Fewer drafts kept than sent: their positions are still in every hop's cache.
        self.rollback = len(tokens) - 1 < len(draft)
        if output.done.answered_directly:
            self.stats.direct_tokens += len(tokens)
        return tokens

    # ------------------------------------------------------------------ failures

    def _capacity_refusers(self, error: BaseException) -> set[bytes]:
        """The hops that refused the epoch's new session for capacity (empty: not such a refusal).

        The first hop refuses at open; a later hop's refusal comes back on the first unit, passed on
        as "next hop refused" without naming the hop: of the hops after the first, those this head
        sees the most loaded (gossip and its own sessions) are taken for it."""
        route = self.route
        if (
            route is None
            or self.admitted
            or not isinstance(error, ShardProtocolError)
            or error.code != shard.ERROR_CODE_RESOURCE_EXHAUSTED
            or not error.retryable
        ):
            return set()
        if not self.opened:
            return {route.hops[0].node_id}
        downstream = [hop.node_id for hop in route.hops[1:]]
        if not downstream or not error.detail.startswith("next hop refused"):
            return {route.hops[0].node_id}
        load = {c.node_id: c.load for c in self.driver.sessions.adjust(self.env.candidates())}
        most = max(load.get(node_id, 0.0) for node_id in downstream)
        return {node_id for node_id in downstream if load.get(node_id, 0.0) == most}

    def _refused_for_capacity(self, refusers: set[bytes], error: BaseException) -> None:
        """Leave the refusing hops out of this generation's routes and drop the epoch's session."""
        self.stats.capacity_refusals += 1
        self.busy |= refusers
        self.waiting_since = None
        log.info(
            "generation %s epoch %d: %s refused a new session (%s); trying another replica",
            self.session_id[:8],
            self.epoch,
            ", ".join(short_id(node_id) for node_id in refusers),
            describe(error),
        )
        route, session = self.route, self.session
        self.session = None
        self._drop_hold()
        if session is not None:
            session.abort()
            if route is not None:
                self.driver.spawn(self._release_quietly(route.hops, self.epoch))

    def _drop_hold(self) -> None:
        self.driver.sessions.release(self.held)
        self.held = ()

    def _context_full(self, error: BaseException) -> bool:
        """A step past a session's context once tokens were generated ends the generation normally."""
        return (
            isinstance(error, ShardProtocolError)
            and error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
            and not error.retryable
            and self.transcript.started
        )

    async def _recover(self, error: BaseException) -> None:
        """Act on a route failure: keep the session (its caches are rebuilt next) or drop the route."""
        self.waiting_since = None
        decision = self.policy.decide(error)
        tag = f"generation {self.session_id[:8]} epoch {self.epoch}"
        if decision.recovery is Recovery.GIVE_UP:
            if decision.request_too_large:
                raise ContextLengthExceeded(decision.reason)
            log.warning("%s failed: %s", tag, decision.reason)
            raise GenerationFailed(decision.reason)
        if decision.recovery is Recovery.REBUILD:
            self.stats.rebuilds += 1
            log.info("%s: %s; re-prefilling under the same route session", tag, decision.reason)
            return
        self.stats.reroutes += 1
        route, session, old_epoch = self.route, self.session, self.epoch
        self.session = None
        self._drop_hold()
        if session is not None:
            session.abort()
        if route is not None:
            dead = self.found_dead & set(route.node_ids) or await self._find_dead(route)
            self.excluded |= dead
            self.driver.found_dead(dead)
            alive = [hop for hop in route.hops if hop.node_id not in dead]
            self.driver.spawn(self._release_quietly(alive, old_epoch))
            if dead:
                gone = ", ".join(short_id(node_id) for node_id in dead)
                log.warning("%s: %s; re-routing (gone: %s)", tag, decision.reason, gone)
            else:
                delay = self.policy.settle_delay_s()
                log.warning("%s: %s; every hop answers: re-routing in %.1f s", tag, decision.reason, delay)
                await asyncio.sleep(delay)

    async def _alive(self, node_id: bytes) -> bool:
        try:
            # Bounds a check that hangs; the environment bounds each probe itself.
            async with asyncio.timeout(2 * self.options.probe_timeout_s + 1):
                return await self.env.alive(node_id, self.options.probe_timeout_s)
        except (TimeoutError, *ROUTE_FAILURES):
            return False

    async def _find_dead(self, route: Route) -> set[bytes]:
        answers = await asyncio.gather(*(self._alive(hop.node_id) for hop in route.hops))
        return {hop.node_id for hop, alive in zip(route.hops, answers, strict=True) if not alive}

    async def _watch(self) -> None:
        """Probe the route's hops while a unit stays unanswered; abort the session if one is gone."""
        interval = self.options.stall_probe_s / 2
        while True:
            await asyncio.sleep(interval)
            since, session, route = self.waiting_since, self.session, self.route
            if since is None or session is None or route is None:
                continue
            if time.monotonic() - since < self.options.stall_probe_s:
                continue
            dead = await self._find_dead(route)
            if dead and self.session is session and self.waiting_since is not None:
                self.found_dead |= dead
                log.warning(
                    "generation %s: hop %s stopped answering; failing over",
                    self.session_id[:8],
                    ", ".join(short_id(node_id) for node_id in dead),
                )
                session.abort()
            else:
                await asyncio.sleep(self.options.stall_probe_s)

    # ------------------------------------------------------------------ the end

    async def _end(self, outcome: str, *, interrupted: bool) -> None:
        """Cancel and release what the generation holds, then count it as over."""
        try:
            await self._finish(interrupted=interrupted)
        finally:
            self._drop_hold()
            self.stats.active -= 1
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    async def _finish(self, *, interrupted: bool) -> None:
        session, route = self.session, self.route
        if session is None or route is None:
            return
        self.session = None
        hops = route.hops
        if not interrupted:
            await session.aclose(release=True, timeout=self.options.control_timeout_s)
            return
        cancels = await asyncio.gather(
            self._bounded(session.cancel(reason="the generation was closed")),
            *(self._unary_cancel(hop) for hop in hops[1:]),
        )
        await session.aclose(release=True, timeout=self.options.control_timeout_s)
        releases = await asyncio.gather(*(self._unary_release(hop, self.epoch) for hop in hops))
        self.stats.last_cancel = CancelReport(
            route_session_id=self.session_id,
            route_epoch=self.epoch,
            hops=tuple(short_id(hop.node_id) for hop in hops),
            cancel_acknowledged=tuple(short_id(h.node_id) for h, ok in zip(hops, cancels, strict=True) if ok),
            release_acknowledged=tuple(
                short_id(h.node_id) for h, ok in zip(hops, releases, strict=True) if ok
            ),
        )
        log.info(
            "generation %s closed mid-step: cancel acknowledged by %d of %d hops",
            self.session_id[:8],
            len(self.stats.last_cancel.cancel_acknowledged),
            len(hops),
        )

    async def _bounded(self, call: Awaitable[object]) -> bool:
        try:
            async with asyncio.timeout(self.options.control_timeout_s):
                await call
            return True
        except (TimeoutError, *ROUTE_FAILURES) as exc:
            log.debug("generation %s: control call failed: %s", self.session_id[:8], exc)
            return False

    async def _unary_cancel(self, hop: Hop) -> bool:
        request = shard.CancelRequest(
            schema_version=HIGHEST_SCHEMA_VERSION,  # type: ignore[arg-type]
            route_session_id=self.session_id,
            route_epoch=self.epoch,
            reason="the generation was closed",
        )

        async def call() -> None:
            link = await self.env.link(hop.node_id)
            await rpc.send_cancel(link, request, timeout=self.options.control_timeout_s)

        return await self._bounded(call())

    async def _unary_release(self, hop: Hop, epoch: int) -> bool:
        request = shard.ReleaseRequest(
            schema_version=HIGHEST_SCHEMA_VERSION,  # type: ignore[arg-type]
            route_session_id=self.session_id,
            route_epoch=epoch,
        )

        async def call() -> None:
            link = await self.env.link(hop.node_id)
            await rpc.send_release(link, request, timeout=self.options.control_timeout_s)

        return await self._bounded(call())

    async def _release_quietly(self, hops: Sequence[Hop], epoch: int) -> None:
        """Drop an abandoned epoch's state on the hops still alive (a newer epoch would too)."""
        await asyncio.gather(*(self._unary_release(hop, epoch) for hop in hops))


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


def _token(output: StepOutput) -> int:
    token = output.token
    if token is None:
        raise ShardProtocolError(
            "the route ended without sampling a token", code=shard.ERROR_CODE_INTERNAL, retryable=True
        )
    return token


def _hop_text(hop: Hop) -> str:
    return f"{short_id(hop.node_id)}[{hop.effective_start_layer}:{hop.end_layer})"


__all__ = [
    "CancelReport",
    "DriverOptions",
    "DriverStats",
    "GenerationDriver",
    "GenerationStream",
    "RouteEnvironment",
]
