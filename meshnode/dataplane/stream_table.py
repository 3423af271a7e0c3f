"""A shard worker's streams and everything said on them: replies, credit and direct answers.

:class:`StreamTable` owns the streams registered with the worker, the answer stream each head
opened for its session (direct answer), and the one rule every reply follows: a unit is
answered exactly once — its result chunk (on the answer stream when the head opened one), then
its Ack, or a ShardStatus — and answering it returns its credit, widened toward
``max_inflight_chunks`` while the worker's queue has room. What it says goes to the worker's
outbox (the :class:`~.actions.Action` list the edge carries out, in order).
"""

from __future__ import annotations

from meshnode.dataplane import responses
from meshnode.dataplane.actions import Action, CloseStream, Send
from meshnode.dataplane.batch_former import BatchFormer
from meshnode.dataplane.lease import StreamOrigin
from meshnode.dataplane.steps import StepRecord
from meshnode.dataplane.worker_state import SessionState, StreamPhase, StreamState, Unit
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


class StreamTable:
    def __init__(self, outbox: list[Action], queue: BatchFormer, *, max_queue_depth: int) -> None:
        self._outbox = outbox
        # Credit widens only while the units waiting stay under half the queue's depth.
        self._queue = queue
        self._max_queue_depth = max_queue_depth
        self._streams: dict[int, StreamState] = {}
        self._next_stream_id = 1
        # Direct answer: the answer stream a head opened for (session id, epoch), newest kept.
        self._answer_streams: dict[tuple[str, int], int] = {}
        # Results sent straight to a session's head on its answer stream.
        self.direct_answers = 0

    def open(self, origin: StreamOrigin) -> int:
        stream_id = self._next_stream_id
        self._next_stream_id += 1
        self._streams[stream_id] = StreamState(stream_id, origin)
        return stream_id

    def __getitem__(self, stream_id: int) -> StreamState:
        return self._streams[stream_id]

    def get(self, stream_id: int) -> StreamState | None:
        return self._streams.get(stream_id)

    def remove(self, stream_id: int) -> None:
        del self._streams[stream_id]

    def serves(self, stream_id: int) -> bool:
        """Whether ``stream_id`` is registered and not closed."""
        stream = self._streams.get(stream_id)
        return stream is not None and stream.phase is not StreamPhase.CLOSED

    def close(self, stream: StreamState) -> None:
        """Nothing more is read or said on ``stream``; an answer stream stops taking answers."""
        stream.phase = StreamPhase.CLOSED
        if stream.answer_only:
            key = (stream.session_id, stream.epoch)
            if self._answer_streams.get(key) == stream.id:
                del self._answer_streams[key]

    def take_answers(self, stream: StreamState) -> None:
        """``stream`` is now its session's answer stream (a newer one replaces an older)."""
        self._answer_streams[(stream.session_id, stream.epoch)] = stream.id

    def answer_stream(self, session: SessionState) -> StreamState | None:
        """The open answer stream of ``session``'s head, if it opened one."""
        stream_id = self._answer_streams.get((session.session_id, session.epoch))
        stream = None if stream_id is None else self._streams.get(stream_id)
        return stream if stream is not None and stream.phase is StreamPhase.OPEN else None

    # ------------------------------------------------------------------ saying things

    def send(self, stream: StreamState, response: shard.SessionResponse) -> None:
        if stream.phase is not StreamPhase.CLOSED:
            self._outbox.append(Send(stream.id, response))

    def status(
        self,
        stream: StreamState,
        work_id: str,
        step: int,
        error: ShardProtocolError,
        *,
        terminal: bool = False,
    ) -> None:
        self.send(stream, responses.status(work_id, stream.session_id, step, error, terminal=terminal))

    def terminate(self, stream: StreamState, error: ShardProtocolError) -> None:
        """End ``stream`` with ``error`` (a terminal status, then the close)."""
        self.status(stream, "", 0, error, terminal=True)
        self._outbox.append(CloseStream(stream.id, error.code_name))
        self.close(stream)

    def refuse_unit(self, stream: StreamState, work_id: str, step: int, error: ShardProtocolError) -> None:
        """A unit refused on arrival (never queued): its status, and its credit back."""
        self.status(stream, work_id, step, error)
        self._credit_returned(stream)

    def succeed(self, unit: Unit, record: StepRecord, *, duplicate: bool) -> None:
        if unit.answered:
            return
        unit.answered = True
        stream = self._streams.get(unit.stream_id)
        if stream is None or stream.phase is not StreamPhase.OPEN:
            return
        answered_directly = record.answered_directly
        if record.result is not None:
            # The tail's token goes straight to the head when the head opened an answer stream;
            # the sender still gets its Ack (credit, cache position) on its own stream.
            answers = self.answer_stream(unit.session)
            if answers is not None:
                self._outbox.append(Send(answers.id, record.result))
                answered_directly = True
                self.direct_answers += 1
            else:
                self._outbox.append(Send(stream.id, record.result))
        ack = responses.ack(
            unit.work_id,
            unit.step,
            record.cache_result,
            duplicate=duplicate,
            execution_nanos=record.execution_nanos,
            answered_directly=answered_directly,
            commitments=record.commitments,
        )
        self._outbox.append(Send(stream.id, ack))
        self._credit_returned(stream)

    def fail(self, unit: Unit, error: ShardProtocolError) -> None:
        if unit.answered:
            return
        unit.answered = True
        stream = self._streams.get(unit.stream_id)
        if stream is None or stream.phase is not StreamPhase.OPEN:
            return
        self.status(stream, unit.work_id, unit.step, error)
        self._credit_returned(stream)

    def _credit_returned(self, stream: StreamState) -> None:
        stream.unacked -= 1
        flow = stream.flow
        assert flow is not None
        # Widen the window toward max_inflight_chunks while the worker has headroom.
        if stream.window < flow.max_inflight_chunks and self._queue.queued < self._max_queue_depth // 2:
            stream.window += 1
            self.send(stream, responses.credit_grant(flow, 1))


__all__ = ["StreamTable"]
