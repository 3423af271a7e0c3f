"""The caller's side of a shard session over any :class:`~meshnode.transport.base.PeerLink`.

:class:`ShardSession` is the asyncio edge of the sans-IO
:class:`~meshnode.dataplane.client.SessionClient`: it is what a head (or a worker
forwarding to its next hop) uses. It depends only on the link abstraction, so it
runs unchanged over QUIC, a relay channel or the in-process loopback::

    async with ShardSession.open(
        lambda: node.get_link(head_id),         # or one PeerLink (no reconnect elsewhere)
        fingerprint=served.fingerprint,         # from the head's ServedShard announcement
        shard_range=ShardRange(start_layer=0, end_layer=3, effective_start_layer=0),
        downstream=[make_hop(tail_id, 3, 6, 3)],  # meshnode.dataplane.route
        sampling=GREEDY,
    ) as session:                               # leaving releases the session on every hop
        first = await session.prefill(prompt_tokens, deadline_unix_ns=time.time_ns() + 10**10)
        token = first.token
        for position in range(len(prompt_tokens), limit):
            token = (await session.decode(token, position=position)).token

``return_logits=True`` adds the tail's last-position logits (``output.logits``);
``boundary_dtype=DTYPE_BFLOAT16`` halves the activation bytes between hops.
Deadlines (``deadline_unix_ns``) are wall-clock unix nanoseconds, as envelopes carry
them (0: none); the session times them on the monotonic clock from when they are
given, so a wall-clock step afterwards does not fail them early or late.

Behaviour:

- Units are pipelined: start several ``decode``/``submit_*`` calls at once and
  they go out as credit allows; each result is its own future.
- A lost stream (reset, link closed, a peer that breaks the protocol) is
  re-opened, on the same link or on a new one when ``links`` is a factory, and
  every unanswered unit goes out again as the same bytes (same idempotency step
  and work id), so a worker that already applied it answers a duplicate.
  After ``max_reconnects`` consecutive failed streams the session is abandoned.
- Errors are typed: a worker's refusal raises
  :class:`~meshnode.wire.errors.ShardProtocolError` with its exact code; a peer
  that is gone raises :class:`~meshnode.dataplane.errors.SessionTransportError`
  (a unit with a deadline fails that way shortly after its deadline).
- :meth:`ShardSession.cancel` goes out of band by default (a fresh SHARD_CANCEL
  stream), so it reaches a worker even when this session's stream is wedged.
- Direct answer (``answers=DirectAnswers(...)``, for a head whose route has more than one
  hop): the session also opens an answer stream to the tail, over the tail's own link
  (a relayed tail through the relay, with the same frames), and the tail's tokens come
  straight back on it instead of through every stage; Acks and credits still come hop
  by hop. Until the tail has the answer stream, and after it is lost, the tail answers
  along the route as before, so the session never depends on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engines.interface import GREEDY, SamplingParams
from meshnode.dataplane.actions import ForwardWork
from meshnode.dataplane.client import (
    ClientConfig,
    PeerRefusal,
    SessionClient,
    SessionFailed,
    SessionNotReady,
    SessionReady,
)
from meshnode.dataplane.client_events import UnitCommitted, UnitDone, UnitFailed
from meshnode.dataplane.client_units import PrefixBlocks
from meshnode.dataplane.edges import rpc
from meshnode.dataplane.edges.answer_stream import AnswerStream, DirectAnswers
from meshnode.dataplane.edges.stream_io import (
    LinkFactory,
    LinkSource,
    SessionLinks,
    reset_quietly,
    write_frames,
)
from meshnode.dataplane.edges.unit_futures import SessionFutures, UnitHandle
from meshnode.dataplane.edges.wake_timer import WakeTimer
from meshnode.dataplane.envelope import Deadline
from meshnode.dataplane.errors import SessionTransportError
from meshnode.dataplane.route import make_route
from meshnode.dataplane.step_outputs import PrefillOutput, StepOutput
from meshnode.dataplane.unit_journal import JournalEntry
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import PeerLink
from meshnode.transport.framed import READ_CHUNK, FramedStream
from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.framing import FrameDecoder, StreamType
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


def default_client_config() -> ClientConfig:
    # The grace lets the worker's own DEADLINE_EXCEEDED win over a local "no answer".
    return ClientConfig(answer_grace_ns=SECOND_NS // 4)


@dataclass(frozen=True)
class SessionConfig:
    open_timeout_s: float = 10.0
    # Consecutive streams that may fail (open or die before SessionAccepted) before giving up.
    max_reconnects: int = 3
    reconnect_backoff_s: float = 0.05
    unary_timeout_s: float = rpc.DEFAULT_UNARY_TIMEOUT_S


# ---------------------------------------------------------------------------- the session


class ShardSession:
    """One route session toward one peer. Create with :meth:`open` (waits for the worker to accept)
    or :meth:`create` (connects in the background; units queue until the session is accepted)."""

    def __init__(
        self,
        links: LinkSource,
        client: SessionClient,
        options: SessionConfig | None = None,
        answers: DirectAnswers | None = None,
    ) -> None:
        self.client = client
        self.options = options or SessionConfig()
        self._links = SessionLinks(links)
        self._loop = asyncio.get_running_loop()
        self._futures = SessionFutures(self._loop)
        self._framed: FramedStream | None = None
        self._signals: list[bytes] = []
        self._writing = False
        self._flush_task: asyncio.Task[None] | None = None
        self._demand = asyncio.Event()
        self._timer = WakeTimer(self._on_timer)
        self._failures = 0
        self._closed = False
        self.error: MeshnodeError | None = None
        self._task = self._loop.create_task(self._run())
        # Set while no Ack of a unit answered directly is owed (see aclose).
        self._acks_settled = asyncio.Event()
        self._acks_settled.set()
        # Handed every signed commitment the Acks carry (meshnode.audit), unchecked; None: dropped.
        self.commitment_sink: Callable[[tuple[shard.SignedCommitment, ...]], None] | None = None
        # The answer stream to the tail, when the head asked for one.
        self._answers = (
            None
            if answers is None
            else AnswerStream(
                client,
                answers,
                self.settle,
                max_reconnects=self.options.max_reconnects,
                reconnect_backoff_s=self.options.reconnect_backoff_s,
            )
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        links: LinkSource,
        *,
        fingerprint: shard.Fingerprint,
        shard_range: shard.ShardRange,
        route: dataplane.SessionRoute | None = None,
        downstream: Sequence[dataplane.RouteHop] = (),
        sampling: SamplingParams = GREEDY,
        boundary_dtype: shard.DType = shard.DTYPE_FLOAT32,
        compression: shard.Compression = shard.COMPRESSION_NONE,
        return_logits: bool = False,
        pipeline_stages: int = 0,
        route_session_id: str | None = None,
        route_epoch: int = 1,
        first_step: int = 1,
        config: ClientConfig | None = None,
        options: SessionConfig | None = None,
        answers: DirectAnswers | None = None,
    ) -> ShardSession:
        """A session that connects in the background. ``route`` (the SessionRoute first frame) is
        built from ``downstream``/``sampling``/``boundary_dtype``/``compression``/``return_logits``/
        ``pipeline_stages`` unless given. ``route_session_id`` defaults to a fresh random id. ``answers``: take the
        tail's tokens directly from it (a head's session with ``downstream`` hops)."""
        if route is None:
            route = make_route(
                list(downstream),
                sampling=sampling,
                boundary_dtype=boundary_dtype,
                compression=compression,
                return_logits=return_logits,
                pipeline_stages=pipeline_stages,
            )
        config = config or default_client_config()
        if answers is not None and not config.direct_answers:
            config = replace(config, direct_answers=True)
        client = SessionClient(
            route_session_id=route_session_id or uuid.uuid4().hex,
            route_epoch=route_epoch,
            fingerprint=fingerprint,
            shard_range=shard_range,
            route=route,
            config=config,
            first_step=first_step,
        )
        return cls(links, client, options, answers)

    @classmethod
    def open(cls, links: LinkSource, **kwargs: Any) -> _Opening:
        """``await ShardSession.open(...)`` or ``async with ShardSession.open(...) as session``:
        returns once the worker accepted the session; raises its refusal (e.g.
        FINGERPRINT_MISMATCH) or SessionTransportError. Arguments as :meth:`create`."""
        return _Opening(lambda: cls.create(links, **kwargs))

    async def wait_ready(self) -> None:
        try:
            async with asyncio.timeout(self.options.open_timeout_s):
                await asyncio.shield(self._futures.ready)
        except TimeoutError:
            self._abandon(SessionTransportError("the session was not accepted in time"))
            raise SessionTransportError("the session was not accepted in time") from None

    # ------------------------------------------------------------------ state

    @property
    def route_session_id(self) -> str:
        return self.client.route_session_id

    @property
    def route_epoch(self) -> int:
        return self.client.route_epoch

    @property
    def flow(self) -> shard.FlowControl | None:
        """The limits negotiated at open (None before the first SessionAccepted)."""
        return self.client.flow

    @property
    def next_step(self) -> int:
        return self.client.next_step

    @property
    def closed(self) -> bool:
        """Closed by us, or over (terminal refusal, transport given up): create a new session."""
        return self._closed or self.client.failed is not None

    @property
    def link(self) -> PeerLink | None:
        return self._links.link

    async def answers_ready(self) -> bool:
        """Whether the tail accepted this session's answer stream (False: none asked for, lost or
        refused; the tokens then come back along the route)."""
        return False if self._answers is None else await asyncio.shield(self._answers.ready)

    # ------------------------------------------------------------------ work

    def submit_prefill(
        self,
        inputs: np.ndarray | Sequence[int],
        *,
        first_position: int = 0,
        deadline_unix_ns: int = 0,
        blocks: PrefixBlocks | None = None,
        chunk_allowance_ns: int = 0,
    ) -> list[UnitHandle]:
        """Chunk a prefill within the negotiated limits (needs the session accepted), on the
        prefix cache's grid with ``blocks``; each chunk after the first may end
        ``chunk_allowance_ns`` later than the one before it."""
        self._raise_if_over()
        ids = self.client.submit_prefill(
            inputs,
            first_position=first_position,
            deadline=_deadline(deadline_unix_ns),
            blocks=blocks,
            chunk_allowance_ns=chunk_allowance_ns,
        )
        return self._submitted(ids)

    def submit_decode(
        self,
        value: int | np.ndarray,
        *,
        position: int,
        deadline_unix_ns: int = 0,
        draft: Sequence[int] = (),
        rollback: bool = False,
    ) -> UnitHandle:
        self._raise_if_over()
        unit_id = self.client.submit_decode(
            value, position=position, deadline=_deadline(deadline_unix_ns), draft=draft, rollback=rollback
        )
        return self._submitted([unit_id])[0]

    def submit_replay(self, entry: JournalEntry, *, deadline_unix_ns: int = 0) -> UnitHandle:
        """A unit another session's journal recorded, sent as it was (an audit's replay)."""
        self._raise_if_over()
        return self._submitted([self.client.submit_replay(entry, deadline=_deadline(deadline_unix_ns))])[0]

    def submit_forward(self, work: ForwardWork) -> UnitHandle:
        """A unit a forwarding worker passes on with its own step and work id."""
        self._raise_if_over()
        return self._submitted([self.client.submit_forward(work)])[0]

    def retry(self, handle: UnitHandle | int) -> UnitHandle:
        """Send a failed unit again as the same bytes (same idempotency step and work id)."""
        unit_id = handle if isinstance(handle, int) else handle.unit_id
        self._raise_if_over()
        self.client.retry(unit_id)
        return self._submitted([unit_id])[0]

    async def prefill(
        self, inputs: np.ndarray | Sequence[int], *, first_position: int = 0, deadline_unix_ns: int = 0
    ) -> PrefillOutput:
        """Run a prefill (tokens for a head hop, float32 ``[n, hidden]`` otherwise); raises the first
        chunk's error."""
        await self.wait_ready()
        self._raise_if_over()
        handles = self.submit_prefill(
            inputs, first_position=first_position, deadline_unix_ns=deadline_unix_ns
        )
        return PrefillOutput([await handle for handle in handles])

    async def decode(
        self,
        value: int | np.ndarray,
        *,
        position: int,
        deadline_unix_ns: int = 0,
        draft: Sequence[int] = (),
        rollback: bool = False,
    ) -> StepOutput:
        """One token at ``position`` (the route's caches must hold ``position`` tokens). With
        ``draft`` tokens it is a verify step (``output.tokens``: the tail's choice after each
        position); ``rollback`` first drops the previous verify step's rejected drafts on every
        hop (see :meth:`SessionClient.submit_decode`)."""
        self._raise_if_over()
        unit_id = self.client.submit_decode(
            value, position=position, deadline=_deadline(deadline_unix_ns), draft=draft, rollback=rollback
        )
        (handle,) = self._submitted([unit_id], kick=False)
        # The hot path: write from this task rather than waking a writer task.
        await self._flush()
        return await handle

    async def cancel(self, work_id: str = "", *, reason: str = "", out_of_band: bool = True) -> int | None:
        """Cancel every unit (or only ``work_id``). Units not sent yet fail here as CANCELLED; sent
        ones fail when the worker's CANCELLED statuses arrive. Out of band (default) it returns how
        many units the worker abandoned; in band it returns None."""
        if not out_of_band:
            self._signals.append(self.client.cancel_signal(work_id, reason))
            self.settle()
            return None
        request = self.client.cancel_request(work_id, reason)
        self.settle()
        return await rpc.send_cancel(
            await self._links.current(), request, timeout=self.options.unary_timeout_s
        )

    async def release(self, *, out_of_band: bool = False) -> bool | None:
        """Ask the worker (and the route behind it) to drop this session's state."""
        if not out_of_band:
            self._signals.append(self.client.release_signal())
            self.settle()
            return None
        request = self.client.release_request()
        return await rpc.send_release(
            await self._links.current(), request, timeout=self.options.unary_timeout_s
        )

    async def aclose(self, *, release: bool = True, timeout: float = 2.0) -> None:
        """End the session: a best-effort in-band release (when ``release``), then finish the stream.
        Units still unanswered fail with SessionTransportError."""
        if self._closed:
            return
        if release and self.client.failed is None and self.client.flow is not None:
            if self._framed is not None and not self._acks_settled.is_set():
                # The last tokens came straight from the tail: let their Acks come back along the
                # route first (for half the time), or the release would cancel them on the way.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout / 2):
                        await self._acks_settled.wait()
            try:
                async with asyncio.timeout(timeout):
                    if self._framed is not None and self.client.accepted:
                        self._signals.append(self.client.release_signal())
                        if self._flush_task is not None:
                            await asyncio.shield(self._flush_task)
                        await self._flush()
                    else:  # not connected right now: the worker still holds the session's state
                        await rpc.send_release(await self._links.current(), self.client.release_request())
            except (TimeoutError, MeshnodeError, OSError):
                pass  # best effort: the worker's idle TTL drops what this could not
        self._closed = True
        self._timer.cancel()
        framed, self._framed = self._framed, None
        self._task.cancel()
        flusher = self._flush_task
        if flusher is not None:
            flusher.cancel()
        answer_task = None if self._answers is None else self._answers.task
        self._stop_answers()
        tasks = [t for t in (self._task, flusher, answer_task) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        if framed is not None:
            # The stream may already be gone: nothing to finish then.
            with contextlib.suppress(Exception):
                framed.finish()
        self._abandon(SessionTransportError("the session was closed"))

    def abort(self) -> None:
        """Drop the session at once (no release): reset the stream, fail every unanswered unit."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._task.cancel()
        if self._flush_task is not None:
            self._flush_task.cancel()
        self._stop_answers()
        framed, self._framed = self._framed, None
        reset_quietly(framed)
        self._abandon(SessionTransportError("the session was aborted"))

    def _stop_answers(self) -> None:
        if self._answers is not None:
            self._answers.stop()

    # ------------------------------------------------------------------ internals: units

    def _raise_if_over(self) -> None:
        """A session that is over raises why: the worker's terminal refusal or the transport failure."""
        if self.client.failed is not None:
            raise self.client.failed
        if self._closed:
            raise SessionTransportError("the session was closed")

    def _submitted(self, unit_ids: Iterable[int], *, kick: bool = True) -> list[UnitHandle]:
        handles = self._futures.handles(unit_ids)
        if kick:
            self.settle()
        else:
            self._dispatch()
        if self._framed is None:
            self._demand.set()
        return handles

    def settle(self) -> None:
        """After anything touched the client: settle futures, send what credit allows, re-arm time."""
        self._dispatch()
        if self.client.acks_owed:
            self._acks_settled.clear()
        else:
            self._acks_settled.set()
        if (
            self._framed is not None
            and not self._writing
            and (self._signals or self.client.can_send)
            and (self._flush_task is None or self._flush_task.done())
        ):
            self._flush_task = self._loop.create_task(self._flush())
        self._timer.arm(self.client.get_timer())

    def _dispatch(self) -> None:
        for event in self.client.take_events():
            self._futures.settle(event)
            match event:
                case UnitDone() | UnitCommitted() if event.commitments and self.commitment_sink is not None:
                    self.commitment_sink(event.commitments)
                case UnitFailed() if self.client.journal is not None:
                    # How far a failed unit got on each hop is not known: no faithful replay.
                    self.client.journal.spoil("a unit failed")
                case SessionReady():
                    self._failures = 0
                case SessionFailed():
                    self.error = event.error
                case PeerRefusal():
                    log.debug(
                        "session %s: the worker refused a signal: %s", self.route_session_id, event.error
                    )

    def _abandon(self, error: MeshnodeError) -> None:
        self.client.abandon(error)
        self._dispatch()
        self._timer.cancel()
        self._futures.fail_all(error)

    # ------------------------------------------------------------------ internals: time

    def _on_timer(self) -> None:
        self.client.handle_timer(time.monotonic_ns())
        self.settle()

    # ------------------------------------------------------------------ internals: the stream

    async def _flush(self) -> None:
        """Write pending signals and whatever units the credit allows; one writer at a time."""
        if self._writing:
            return
        self._writing = True
        framed = self._framed
        try:
            while framed is not None and framed is self._framed:
                bodies, self._signals = self._signals, []
                bodies += self.client.requests_to_send(time.monotonic_ns())
                self._dispatch()  # an oversize unit fails as it is taken
                if not bodies:
                    return
                await write_frames(framed, bodies)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The reader notices the reset and re-opens; the units already taken go out again.
            log.debug("session %s: write failed: %s", self.route_session_id, exc)
            reset_quietly(framed)
        finally:
            self._writing = False
            self._timer.arm(self.client.get_timer())

    async def _run(self) -> None:
        """Keep a stream open while there is work; re-open it after a failure."""
        opened_once = False
        while not self._closed and self.client.failed is None:
            if opened_once and not self.client.outstanding and not self._signals:
                # Nothing owed: re-open lazily, when work arrives.
                self._demand.clear()
                await self._demand.wait()
                continue
            opened_once = True
            reason = await self._one_stream()
            if self._closed or self.client.failed is not None:
                return
            self._failures += 1
            self.client.stream_lost()
            self._dispatch()
            if self._failures > self.options.max_reconnects:
                log.info("session %s: giving up on the worker: %s", self.route_session_id, reason)
                self._abandon(SessionTransportError(f"the worker is unreachable: {reason}"))
                return
            await asyncio.sleep(self.options.reconnect_backoff_s * self._failures)

    async def _one_stream(self) -> str:
        """Open a stream, serve it until it ends; returns why it ended."""
        framed: FramedStream | None = None
        try:
            link = await self._links.current()
            framed = await link.open_stream(StreamType.SHARD_SESSION)
            route_body, open_body = self.client.start_stream()
            await write_frames(framed, [route_body, open_body])
            self._framed = framed
            self.settle()
            # Read the stream directly so that every frame of one read is handled before one _after().
            # The downstream hop is a member, not trusted: its replies charge the link's budget.
            stream = framed.stream
            limits = getattr(stream, "read_limits", None)
            decoder = FrameDecoder(expect_stream_type=False, budget=limits.budget if limits else None)
            while data := await stream.read(READ_CHUNK):
                for body in decoder.feed(data):
                    self.client.receive_frame(body)
                self.settle()
            decoder.end_of_stream()
            return "the worker ended the stream"
        except asyncio.CancelledError:
            raise
        except SessionNotReady:
            return "the session is over"
        except ShardProtocolError as exc:
            # The peer broke the protocol on this stream: drop it, the units go out again.
            reset_quietly(framed)
            return str(exc)
        except Exception as exc:
            reset_quietly(framed)
            return str(rpc.transport_error("session stream", exc))
        finally:
            if self._framed is framed:
                self._framed = None


class _Opening:
    """What :meth:`ShardSession.open` returns: awaitable, or an async context manager that closes
    (and releases) the session on exit."""

    def __init__(self, factory: Callable[[], ShardSession]) -> None:
        self._factory = factory
        self._session: ShardSession | None = None

    async def _open(self) -> ShardSession:
        session = self._factory()
        try:
            await session.wait_ready()
        except BaseException:
            session.abort()
            raise
        self._session = session
        return session

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> ShardSession:
        return await self._open()

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.aclose()


def _deadline(deadline_unix_ns: int) -> Deadline | None:
    """A caller's deadline (unix ns, 0: none) on both clocks, read now."""
    return Deadline.from_unix(deadline_unix_ns, now_ns=time.monotonic_ns(), unix_now_ns=time.time_ns())


__all__ = [
    "DirectAnswers",
    "LinkFactory",
    "LinkSource",
    "PrefillOutput",
    "SessionConfig",
    "ShardSession",
    "StepOutput",
    "UnitHandle",
    "default_client_config",
]
