"""Fetch a model's manifest and tensors from peers over ARTIFACT streams (the asyncio edge).

``open_link`` is ``node.get_link``; ``sources`` are peer ids. :func:`fetch_manifest`
asks sources in turn until one answers with a manifest that hashes to the root and a
metadata blob that matches its digest. :func:`fetch_tensors` asks every source what it
holds, then runs a few workers per source over one :class:`~.schedule.FetchPlan`:
each tensor streams into the :class:`~.store.PartialModel` (written and hashed in the
fetch's thread, :mod:`.write_behind`, while the event loop reads the next chunk) and is
journaled only once its digest matches (by a :class:`_Committer`, in a thread, while the
workers go on). A source whose bytes do not match (or who breaks the protocol) is
quarantined and its tensor goes to another source; a source whose link fails is
dropped the same way, without blame. When no live source holds what is still
missing, :class:`TransferError` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engines.model_manifest import ModelManifest
from meshnode.artifacts.progress import TransferProgress
from meshnode.artifacts.protocol import (
    NOT_HELD,
    OVERLOADED,
    ArtifactError,
    BadReply,
    ChunkReceiver,
    Item,
    MetadataItem,
    PeerManifest,
    PeerRefused,
    encode_fetch,
    encode_manifest_query,
    parse_reply,
    verified_manifest,
)
from meshnode.artifacts.schedule import FetchPlan, Quarantine
from meshnode.artifacts.store import PartialModel, StoreError, TensorDigestMismatch, TensorWriter
from meshnode.artifacts.write_behind import TensorWrites, WriteBehind
from meshnode.identity import short_id
from meshnode.transport.base import PeerLink
from meshnode.transport.request_reply import REQUEST_FAILURES
from meshnode.wire.framing import StreamType

log = logging.getLogger(__name__)

OpenLink = Callable[[bytes], Awaitable[PeerLink]]

# Tensors in flight per source: enough to keep a link busy across request round trips.
IN_FLIGHT_PER_SOURCE = 2
# A tensor's bytes are made durable and recorded for resuming each time this many more arrived.
CHECKPOINT_BYTES = 32 << 20
# A frame must arrive within this long, or the source is treated as failed.
FRAME_TIMEOUT_S = 30.0
# An overloaded source is retried after a growing pause, this many times per worker.
OVERLOAD_RETRIES = 6
_OVERLOAD_BACKOFF_S = 0.1

# What talking to one source can raise, all of it handled by dropping or quarantining it.
_SOURCE_FAILURES: tuple[type[Exception], ...] = (*REQUEST_FAILURES, ArtifactError, OSError)


class TransferError(Exception):
    """The fetch ended with tensors still missing: no live source holds them."""

    def __init__(self, missing: Sequence[str], reasons: dict[bytes, str]) -> None:
        self.missing = tuple(missing)
        self.reasons = dict(reasons)
        why = "; ".join(f"{short_id(peer)}: {reason}" for peer, reason in reasons.items()) or "no sources"
        shown = ", ".join(self.missing[:5]) + (" ..." if len(self.missing) > 5 else "")
        super().__init__(f"{len(self.missing)} tensors could not be fetched ({shown}); sources: {why}")


@dataclass
class FetchReport:
    # Reply bytes (frames' bodies) received from each source during the fetch.
    bytes_by_source: dict[bytes, int] = field(default_factory=dict)
    fetched: tuple[str, ...] = ()
    # Asked for but already verified on disk (a resumed fetch).
    resumed: tuple[str, ...] = ()
    quarantined: dict[bytes, str] = field(default_factory=dict)
    # Sources dropped without blame (link failed, refused, overloaded).
    failed_sources: dict[bytes, str] = field(default_factory=dict)

    @property
    def bytes_received(self) -> int:
        return sum(self.bytes_by_source.values())


def _root_bytes(root: bytes | str) -> bytes:
    return bytes.fromhex(root) if isinstance(root, str) else root


# ------------------------------------------------------------------------------ requests


async def _query_manifest(link: PeerLink, root: bytes, received: Counter[bytes]) -> PeerManifest:
    stream = await link.open_stream(StreamType.ARTIFACT)
    try:
        await stream.send_frame(encode_manifest_query(root))
        stream.finish()
        body = await stream.recv_frame(timeout=FRAME_TIMEOUT_S)
    except BaseException:
        stream.close()
        raise
    # One frame is the whole reply (a manifest or a refusal): the exchange is over, cleanly.
    stream.release()
    if body is None:
        raise BadReply("stream ended without a manifest reply")
    received[link.peer_id] += len(body)
    return verified_manifest(parse_reply(body), root)


async def _fetch_item(
    link: PeerLink,
    root: bytes,
    item: Item,
    nbytes: int,
    sink: Callable[[bytes], None],
    received: Counter[bytes],
    offset: int = 0,
    after_chunk: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Stream item ``item`` (``nbytes`` long, from the verified manifest) from ``offset`` to its
    end into ``sink``, awaiting ``after_chunk`` after each chunk it takes.

    The stream is released (on the bulk lane, its connection may carry the next request)
    only when the reply was read to its end: the end marker, or a refusal, which is a whole
    reply; on anything else it is closed."""
    stream = await link.open_stream(StreamType.ARTIFACT)
    try:
        await stream.send_frame(encode_fetch(root, item, offset=offset))
        stream.finish()
        receiver = ChunkReceiver(offset, nbytes - offset)
        while not receiver.finished:
            body = await stream.recv_frame(timeout=FRAME_TIMEOUT_S)
            if body is None:
                raise BadReply(f"stream ended at byte {receiver.next_offset} of {nbytes}")
            received[link.peer_id] += len(body)
            data = receiver.accept(parse_reply(body))
            if data is not None:
                sink(data)
                if after_chunk is not None:
                    await after_chunk()
    except PeerRefused:
        stream.release()
        raise
    except BaseException:
        stream.close()
        raise
    stream.release()


# ------------------------------------------------------------------------------ manifest


async def fetch_manifest(
    open_link: OpenLink,
    root: bytes | str,
    sources: Iterable[bytes],
    *,
    quarantine: Quarantine | None = None,
) -> tuple[ModelManifest, bytes]:
    """The verified manifest and metadata blob of model ``root``, from the first source that has them.

    The blob's length is the one thing taken from a peer before it can be checked (the root
    covers its digest, not its size); it is capped at ``MAX_METADATA_BYTES`` and the blob is
    checked against the digest before it is returned. A source whose reply does not verify
    is quarantined; :class:`TransferError` when no source answers."""
    root = _root_bytes(root)
    quarantine = quarantine if quarantine is not None else Quarantine()
    received: Counter[bytes] = Counter()
    reasons: dict[bytes, str] = {}
    for source in sources:
        if source in quarantine:
            continue
        try:
            link = await open_link(source)
            answer = await _query_manifest(link, root, received)
            blob = bytearray()
            await _fetch_item(link, root, MetadataItem.BLOB, answer.metadata_nbytes, blob.extend, received)
        except BadReply as error:
            quarantine.add(source, f"manifest: {error}")
            reasons[source] = str(error)
            continue
        except _SOURCE_FAILURES as error:
            reasons[source] = _describe(error)
            continue
        if hashlib.sha256(blob).hexdigest() != answer.manifest.metadata_sha256:
            quarantine.add(source, "metadata blob does not match its digest")
            reasons[source] = "metadata blob does not match its digest"
            continue
        return answer.manifest, bytes(blob)
    raise TransferError(["<manifest>"], reasons)


# ------------------------------------------------------------------------------- tensors


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _Outcome(enum.Enum):
    """How one tensor request to one source ended."""

    DONE = "done"
    QUARANTINED = "quarantined"
    NOT_HELD = "not held"
    OVERLOADED = "overloaded"
    REFUSED = "refused"
    FAILED = "failed"
    # A resumed tensor's bytes did not match: dropped, to be fetched whole.
    RESTARTED = "restarted"


class _Committer:
    """Makes verified tensors durable and journals them, in a worker thread, while the workers
    fetch the next ones; whatever was verified meanwhile is committed as one batch
    (:meth:`~.store.PartialModel.commit_verified`: one fsync of the file and one of the journal).

    A commit per tensor, awaited by its worker, made every tensor wait for two fsyncs
    before its worker asked for the next one: most of a fetch's time on a fast lane. The crash
    rule is unchanged, since nothing counts as verified before its journal line is durable,
    and :meth:`flush` is awaited before the fetch reports anything.
    """

    def __init__(self, partial: PartialModel) -> None:
        self._partial = partial
        self._queue: list[TensorWriter] = []
        self._task: asyncio.Task[None] | None = None
        self.error: StoreError | None = None

    def add(self, writer: TensorWriter) -> None:
        """Commit ``writer``'s tensor (verified) soon; StoreError if an earlier commit failed."""
        if self.error is not None:
            raise self.error
        self._queue.append(writer)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def flush(self) -> None:
        """Wait until every tensor added is journaled; StoreError where the local disk failed.
        Not cancelled with its caller: a commit under way finishes before the model is closed."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        if self.error is not None:
            raise self.error

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await asyncio.to_thread(self._partial.commit_verified, batch)
            except OSError as error:
                names = ", ".join(repr(writer.tensor.name) for writer in batch)
                self.error = StoreError(f"cannot journal {names}: {error}")
                return


class _TensorFetch:
    """One fetch_tensors call: the plan, the workers, and what they report."""

    def __init__(
        self,
        open_link: OpenLink,
        partial: PartialModel,
        root: bytes,
        progress: TransferProgress | None,
        quarantine: Quarantine,
    ) -> None:
        self.open_link = open_link
        self.partial = partial
        self.root = root
        self.progress = progress
        self.quarantine = quarantine
        self.received: Counter[bytes] = Counter()
        self.failed: dict[bytes, str] = {}
        self.plan = FetchPlan((), {})
        self.changed = asyncio.Condition()
        self.workers: Counter[bytes] = Counter()
        self.committer = _Committer(partial)
        self.write_behind = WriteBehind()

    async def holdings_of(self, source: bytes) -> frozenset[int] | None:
        try:
            link = await self.open_link(source)
            answer = await _query_manifest(link, self.root, self.received)
        except BadReply as error:
            self.quarantine.add(source, f"manifest: {error}")
            return None
        except _SOURCE_FAILURES as error:
            self.failed[source] = _describe(error)
            return None
        return answer.held

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def next_tensor(self, source: bytes) -> int | None:
        """The next tensor for ``source``, waiting while one it holds is in flight elsewhere
        (it may come back); ``None`` when there is nothing left it could fetch."""
        async with self.changed:
            # Checked and waited for under the lock, so no notify falls between the two.
            while (index := self.plan.take(source)) is None:
                if not self.plan.may_get_work(source):
                    return None
                await self.changed.wait()
            return index

    async def worker(self, source: bytes) -> None:
        overloads = 0
        try:
            while True:
                index = await self.next_tensor(source)
                if index is None:
                    return
                outcome = await self.fetch_one(source, index)
                if outcome is _Outcome.OVERLOADED:
                    overloads += 1
                    if overloads > OVERLOAD_RETRIES:
                        self.failed.setdefault(source, f"overloaded {overloads} times in a row")
                        return
                    await asyncio.sleep(_OVERLOAD_BACKOFF_S * 2**overloads)
                else:
                    overloads = 0
                await self.notify()
        finally:
            self.workers[source] -= 1
            if self.workers[source] == 0:
                self.plan.lose(source, self.failed.get(source, "no more work"))
            await self.notify()

    async def fetch_one(self, source: bytes, index: int) -> _Outcome:
        tensor = self.partial.manifest.tensors[index]
        try:
            if self.partial.unfinished_bytes(tensor.name):
                # Goes on from bytes an earlier attempt left, which it reads back from disk first.
                writer = await asyncio.to_thread(self.partial.writer, tensor.name)
            else:
                # Nothing to read back: a thread hop per tensor would cost more than the writer.
                writer = self.partial.writer(tensor.name)
        except OSError as error:
            raise StoreError(f"cannot read back {tensor.name!r}: {error}") from error

        # Written and hashed in the fetch's thread; a failure of our disk there (StoreError) is
        # raised by the awaits below and ends the whole fetch, never blamed on the source.
        writes = self.write_behind.writes(writer)

        def sink(data: bytes) -> None:
            writes.write(data)
            if self.progress is not None:
                self.progress.advance(len(data), time.monotonic_ns())

        kept = writer.written

        async def after_chunk() -> None:
            await writes.wait_below_limit()
            # Now and then what arrived is made durable and counted, so that even a SIGKILL loses
            # only the bytes since (a cancelled or failed fetch keeps everything that arrived).
            nonlocal kept
            if writes.given - kept >= CHECKPOINT_BYTES:
                await writes.drain()
                kept = writer.written
                await asyncio.to_thread(self._keep, writer)

        try:
            # Asked per tensor: the node keeps one link per peer and redials one that dropped.
            link = await self.open_link(source)
            await _fetch_item(
                link, self.root, index, tensor.nbytes, sink, self.received, writer.written, after_chunk
            )
            await writes.drain()
            writer.verify()
            self.committer.add(writer)
        except TensorDigestMismatch as error:
            self._settle(writes)
            self._rewind(writes.given)
            self.partial.discard(tensor.name)
            self.plan.give_back(index)
            if writer.resumed:
                # Part of the bytes came from an earlier attempt, maybe from another source: blame
                # nobody, fetch it whole (a source that then sends wrong bytes is quarantined).
                log.info("%s did not match its digest after resuming; fetching it whole", tensor.name)
                return _Outcome.RESTARTED
            return self._quarantined(source, index, f"tensor {tensor.name!r}: {error}")
        except BadReply as error:
            self._settle(writes)
            self._rewind(writes.given)
            self.partial.discard(tensor.name)
            self.plan.give_back(index)
            return self._quarantined(source, index, f"tensor {tensor.name!r}: {error}")
        except PeerRefused as refusal:
            self._settle(writes)
            self._keep(writer)
            if refusal.code == NOT_HELD:
                self.plan.give_back(index, not_held_by=source)
                return _Outcome.NOT_HELD
            self.plan.give_back(index)
            if refusal.code == OVERLOADED:
                return _Outcome.OVERLOADED
            self.failed[source] = str(refusal)
            self.plan.lose(source, str(refusal))
            return _Outcome.REFUSED
        except _SOURCE_FAILURES as error:
            self._settle(writes)
            self._keep(writer)
            self.plan.give_back(index)
            self.failed[source] = _describe(error)
            self.plan.lose(source, _describe(error))
            log.info(
                "source %s failed on %s%s: %s",
                short_id(source),
                tensor.name,
                f" at byte {writer.written} of {tensor.nbytes} (kept, to go on from)"
                if writer.written
                else "",
                _describe(error),
            )
            return _Outcome.FAILED
        except BaseException:
            # Stopped (cancelled, or our disk failed): what arrived is kept for the next run.
            writes.settle()
            with contextlib.suppress(OSError):
                self.partial.keep(writer)
            self.plan.give_back(index)
            raise
        self.plan.succeeded(index, source)
        return _Outcome.DONE

    def _quarantined(self, source: bytes, index: int, reason: str) -> _Outcome:
        self.plan.lose(source, "quarantined")
        self.quarantine.add(source, reason)
        return _Outcome.QUARANTINED

    @staticmethod
    def _settle(writes: TensorWrites) -> None:
        """Wait for every chunk handed over to be written (blocking, but for at most
        PENDING_BYTES of them) before the writer is read; a failure of our disk ends the fetch."""
        writes.settle()
        if writes.error is not None and not isinstance(writes.error, TensorDigestMismatch):
            raise writes.error

    def _keep(self, writer: TensorWriter) -> None:
        """Keep the bytes of a tensor whose source stopped mid-way, for any source to go on from."""
        try:
            self.partial.keep(writer)
        except OSError as error:  # our disk: ends the whole fetch
            raise StoreError(f"cannot keep what arrived of {writer.tensor.name!r}: {error}") from error

    def _rewind(self, nbytes: int) -> None:
        # Progress counts verified-or-arriving bytes; a discarded attempt's bytes are not done.
        if self.progress is not None and nbytes:
            self.progress.advance(-nbytes, time.monotonic_ns())


async def fetch_tensors(
    open_link: OpenLink,
    partial: PartialModel,
    names: Iterable[str],
    sources: Iterable[bytes],
    *,
    progress: TransferProgress | None = None,
    quarantine: Quarantine | None = None,
    in_flight_per_source: int = IN_FLIGHT_PER_SOURCE,
) -> FetchReport:
    """Fetch and verify every tensor of ``names`` that ``partial`` does not hold yet.

    ``progress`` is advanced as bytes arrive (show it with
    :class:`~meshnode.artifacts.progress.ProgressDisplay`); ``quarantine`` may be shared
    between fetches so a liar stays out. Raises :class:`TransferError` naming the tensors no
    source could provide (those fetched before that stay journaled, so a retry resumes),
    :class:`~meshnode.artifacts.store.StoreError` when the local disk fails, and ``KeyError``
    for a name not in the model.
    """
    names = tuple(dict.fromkeys(names))
    missing = partial.missing(names)
    resumed = tuple(name for name in names if name not in missing)
    quarantine = quarantine if quarantine is not None else Quarantine()
    sources = [s for s in dict.fromkeys(sources) if s not in quarantine]
    run = _TensorFetch(open_link, partial, bytes.fromhex(partial.manifest.root), progress, quarantine)
    if progress is not None:
        manifest = partial.manifest
        total = sum(manifest.tensors[partial.index_of(n)].nbytes for n in names)
        done = sum(manifest.tensors[partial.index_of(n)].nbytes for n in resumed)
        done += sum(partial.unfinished_bytes(n) for n in missing)
        progress.begin(total, done, time.monotonic_ns())
    if missing:
        held = await asyncio.gather(*(run.holdings_of(source) for source in sources))
        holders = {s: h for s, h in zip(sources, held, strict=True) if h is not None}
        run.plan = FetchPlan((partial.index_of(n) for n in missing), holders)
        workers: list[asyncio.Task[None]] = []
        for source in holders:
            run.workers[source] = in_flight_per_source
            workers += [asyncio.create_task(run.worker(source)) for _ in range(in_flight_per_source)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            # A local failure (StoreError) or our cancellation: no worker outlives the fetch, and
            # what was verified is still journaled (kept for the next run) before it ends.
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            with contextlib.suppress(StoreError):
                await run.committer.flush()
            raise
        finally:
            # Each worker drained its tensor's writes before it ended: this only stops the thread.
            run.write_behind.close()
        await run.committer.flush()
    if progress is not None:
        progress.finish()
    report = FetchReport(
        bytes_by_source=dict(run.received),
        fetched=tuple(n for n in missing if n in partial.verified),
        resumed=resumed,
        quarantined=quarantine.peers,
        failed_sources=dict(run.failed),
    )
    still_missing = partial.missing(names)
    if still_missing:
        raise TransferError(still_missing, {**run.failed, **report.quarantined})
    return report


__all__ = ["FetchReport", "OpenLink", "TransferError", "fetch_manifest", "fetch_tensors"]
