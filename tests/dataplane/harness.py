"""Drive the sans-IO machines synchronously: no sockets, no threads, time is a number.

``WorkerHarness`` carries out a worker's actions the way an edge would (engine
actions in emission order, results fed back); ``Loopback`` wires a
``SessionClient`` to a worker through real serialization; ``Chain`` runs a
two-worker daisy chain, forwarding the first worker's results to the second
through a client exactly as the asyncio edge will.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from helpers.recording_engine import HIDDEN, LAYERS, RecordingEngine
from helpers.tiny_llama import run_unsplit

from engines.interface import SessionKey
from meshnode.dataplane.actions import (
    Action,
    CancelDownstream,
    FireCancel,
    Forward,
    ReleaseDownstream,
    ReleaseEngine,
    RunBatch,
    Send,
)
from meshnode.dataplane.client import SessionClient, UnitDone, UnitFailed
from meshnode.dataplane.envelope import Deadline
from meshnode.dataplane.lease import LOCAL_ORIGIN, StreamOrigin
from meshnode.dataplane.payload import encode_hidden, encode_tokens
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.worker import DownstreamResult, ShardWorker, WorkerConfig
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle

SECOND = 1_000_000_000
# The two clocks start far apart, so a test that mixed them up would fail: the machines' timers
# and leases run on the monotonic clock, envelope deadlines are wall-clock unix nanoseconds.
NOW = 5_000 * SECOND
UNIX_START = 1_700_000_000 * SECOND
NODE_B = b"\x02" * 32

_FINGERPRINT = RecordingEngine().capabilities().fingerprint
FP = shard.Fingerprint(
    model_artifact_digest=_FINGERPRINT.model_artifact_digest,
    runtime_recipe_digest=_FINGERPRINT.runtime_recipe_digest,
    recipe_id=_FINGERPRINT.recipe_id,
)


def srange(start: int = 0, end: int = LAYERS, effective: int | None = None) -> shard.ShardRange:
    return shard.ShardRange(
        start_layer=start, end_layer=end, effective_start_layer=start if effective is None else effective
    )


def reference(prompt: list[int], decode_steps: int) -> list[int]:
    """Greedy tokens of the whole fake model run directly on one engine (the first, then one a step)."""
    tokens, _ = run_unsplit(RecordingEngine(), prompt, chunk_tokens=len(prompt), decode_steps=decode_steps)
    return tokens


def open_request(
    session_id: str = "s1",
    epoch: int = 1,
    *,
    shard_range: shard.ShardRange | None = None,
    schema: shard.SchemaVersion = shard.SCHEMA_VERSION_1,
    fingerprint: shard.Fingerprint = FP,
    flow: shard.FlowControl | None = None,
) -> shard.SessionRequest:
    return shard.SessionRequest(
        open=shard.SessionOpen(
            schema_version=schema,
            route_session_id=session_id,
            route_epoch=epoch,
            fingerprint=fingerprint,
            shard_range=shard_range or srange(),
            proposed_flow_control=flow or shard.FlowControl(),
            accepted_compression=[shard.COMPRESSION_NONE],
        )
    )


def input_tensor(values: object) -> shard.NamedTensor:
    array = np.asarray(values)
    if array.dtype.kind == "f":
        return encode_hidden(array.astype(np.float32), shard.DTYPE_FLOAT32, shard.COMPRESSION_NONE)
    return encode_tokens(array.astype(np.int32))


def chunk_request(
    step: int,
    values: object,
    *,
    first_position: int = 0,
    chunk: tuple[int, int] = (0, 1),
    session_id: str = "s1",
    epoch: int = 1,
    shard_range: shard.ShardRange | None = None,
    # Wall-clock unix nanoseconds, as the envelope carries it (0: none).
    deadline: int = 0,
    phase: shard.Phase = shard.PHASE_PREFILL,
    work_id: str | None = None,
    fingerprint: shard.Fingerprint = FP,
    schema: shard.SchemaVersion = shard.SCHEMA_VERSION_1,
    tensor: shard.NamedTensor | None = None,
) -> shard.SessionRequest:
    fresh = phase == shard.PHASE_PREFILL and first_position == 0
    tensor = tensor or input_tensor(values)
    n = int(tensor.shape[0])
    env = shard.Envelope(
        schema_version=schema,
        work_id=work_id if work_id is not None else f"w{step}",
        route_session_id=session_id,
        route_epoch=epoch,
        fingerprint=fingerprint,
        shard_range=shard_range or srange(),
        phase=phase,
        position=shard.PositionSpan(first_position=first_position, token_count=n),
        idempotency_step=step,
        cache_expectation=shard.CacheExpectation(
            mode=shard.CACHE_MODE_PREFILL if fresh else shard.CACHE_MODE_DECODE,
            expected_past_len=0 if fresh else first_position,
        ),
        deadline_unix_nanos=deadline,
        chunk=shard.ChunkInfo(
            chunk_index=chunk[0], chunk_count=chunk[1], final_chunk=chunk[0] == chunk[1] - 1
        ),
    )
    return shard.SessionRequest(chunk=shard.ActivationChunk(envelope=env, bundle=encode_bundle([tensor])))


def decode_request(
    step: int,
    value: object,
    position: int,
    *,
    deadline: int = 0,
    work_id: str | None = None,
    tensor: shard.NamedTensor | None = None,
) -> shard.SessionRequest:
    array = np.asarray(value)
    if tensor is None:
        tensor = input_tensor(array.reshape(1, -1) if array.dtype.kind == "f" else array.reshape(1))
    return shard.SessionRequest(
        decode=shard.DecodeStep(
            idempotency_step=step,
            position=position,
            expected_past_len=position,
            tensor=tensor,
            work_id=work_id if work_id is not None else f"w{step}",
            deadline_unix_nanos=deadline,
        )
    )


def responses(actions: list[Action], stream_id: int | None = None) -> list[shard.SessionResponse]:
    return [
        a.response for a in actions if isinstance(a, Send) and (stream_id is None or a.stream_id == stream_id)
    ]


def kinds(items: list[shard.SessionResponse]) -> list[str]:
    return [str(r.WhichOneof("kind")) for r in items]


def only_status(items: list[shard.SessionResponse]) -> shard.ShardStatus:
    statuses = [r.status for r in items if r.WhichOneof("kind") == "status"]
    assert len(statuses) == 1, kinds(items)
    return statuses[0]


def statuses(items: list[shard.SessionResponse]) -> list[shard.ShardStatus]:
    return [r.status for r in items if r.WhichOneof("kind") == "status"]


def acks(items: list[shard.SessionResponse]) -> list[shard.Ack]:
    return [r.ack for r in items if r.WhichOneof("kind") == "ack"]


def result_tokens(items: list[shard.SessionResponse]) -> list[int]:
    from meshnode.wire.tensor_codec import decode_bundle

    return [
        int(decode_bundle(r.chunk.bundle)["token_ids"].array[0])
        for r in items
        if r.WhichOneof("kind") == "chunk"
    ]


class WorkerHarness:
    def __init__(
        self,
        engine: RecordingEngine | None = None,
        config: WorkerConfig | None = None,
        *,
        identity: NodeIdentity | None = None,
    ) -> None:
        self.engine = engine or RecordingEngine()
        self.worker = ShardWorker(self.engine.capabilities(), config, identity=identity)
        # Monotonic now; the wall clock reads ``now + wall_clock_offset`` (a test may step it).
        self.now = NOW
        self.wall_clock_offset = UNIX_START - NOW
        # Carries out Forward / CancelDownstream / ReleaseDownstream; returns the worker actions
        # that the next hop's answers produced.
        self.downstream: Callable[[Action], list[Action]] | None = None
        self.log: list[Action] = []

    def run(self, actions: list[Action]) -> list[Action]:
        """Carry out actions like an edge: engine work in order, results fed back, until idle."""
        out: list[Action] = []
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            self.log.append(action)
            if isinstance(action, RunBatch):
                try:
                    outcome: object = action.execute(self.engine)
                except Exception as exc:
                    outcome = exc
                queue.extend(self.batch_finished(action.batch_id, outcome, self.now))
                continue
            if isinstance(action, ReleaseEngine):
                self.engine.release(action.session)
            elif isinstance(action, FireCancel):
                action.token.cancel()
            elif isinstance(action, Forward | CancelDownstream | ReleaseDownstream) and self.downstream:
                queue.extend(self.downstream(action))
            out.append(action)
        return out

    def open(
        self,
        route: dataplane.SessionRoute | None = None,
        *,
        origin: StreamOrigin = LOCAL_ORIGIN,
        **kwargs: Any,
    ) -> tuple[int, list[shard.SessionResponse]]:
        stream = self.worker.open_stream(origin)
        actions = self.receive_frame(stream, (route or make_route()).SerializeToString(), self.now)
        request = open_request(**kwargs)
        actions += self.receive_frame(stream, request.SerializeToString(), self.now)
        return stream, responses(self.run(actions), stream)

    def send(self, stream: int, request: shard.SessionRequest, *, run: bool = True) -> list[Action]:
        actions = self.receive_frame(stream, request.SerializeToString(), self.now)
        return self.run(actions) if run else actions

    # Each worker input, and the actions it led to (taken from the worker, not carried out).

    @property
    def unix_now(self) -> int:
        return self.now + self.wall_clock_offset

    def deadline(self, after_ns: int) -> Deadline:
        """A deadline ``after_ns`` from now, as a caller gives it to a client."""
        deadline = Deadline.from_unix(self.unix_now + after_ns, now_ns=self.now, unix_now_ns=self.unix_now)
        assert deadline is not None
        return deadline

    def receive_frame(self, stream: int, body: bytes, now_ns: int) -> list[Action]:
        self.worker.receive_frame(stream, body, now_ns, unix_now_ns=now_ns + self.wall_clock_offset)
        return self.worker.take_events()

    def stream_closed(self, stream: int, now_ns: int, *, link_lost: bool = False) -> list[Action]:
        self.worker.stream_closed(stream, now_ns, link_lost=link_lost)
        return self.worker.take_events()

    def batch_finished(self, batch_id: int, outcome: object, now_ns: int) -> list[Action]:
        self.worker.batch_finished(batch_id, outcome, now_ns)
        return self.worker.take_events()

    def downstream_finished(self, unit_id: int, outcome: object, now_ns: int) -> list[Action]:
        self.worker.downstream_finished(unit_id, outcome, now_ns)
        return self.worker.take_events()

    def peer_departed(self, peer_id: bytes, now_ns: int) -> list[Action]:
        self.worker.peer_departed(peer_id, now_ns)
        return self.worker.take_events()

    def handle_timer(self, now_ns: int) -> list[Action]:
        self.worker.handle_timer(now_ns)
        return self.worker.take_events()

    def cancel(self, session_id: str, epoch: int, work_id: str, now_ns: int) -> tuple[int, list[Action]]:
        count = self.worker.cancel(session_id, epoch, work_id, now_ns)
        return count, self.worker.take_events()

    def release(self, session_id: str, epoch: int, now_ns: int) -> tuple[bool, list[Action]]:
        released = self.worker.release(session_id, epoch, now_ns)
        return released, self.worker.take_events()

    def ask(self, stream: int, request: shard.SessionRequest) -> list[shard.SessionResponse]:
        return responses(self.send(stream, request), stream)


class Loopback:
    """A SessionClient talking to a worker through serialized frames, synchronously."""

    def __init__(self, harness: WorkerHarness, client: SessionClient) -> None:
        self.harness = harness
        self.client = client
        self.stream = -1
        # Worker actions for other streams (e.g. statuses of units cancelled elsewhere).
        self.other: list[Action] = []
        self.held: list[Action] = []
        self.hold_engine = False

    def connect(self) -> None:
        self.stream = self.harness.worker.open_stream()
        for body in self.client.start_stream():
            self.deliver(body)

    def deliver(self, body: bytes) -> None:
        self.feed(self.harness.receive_frame(self.stream, body, self.harness.now))

    def feed(self, actions: list[Action]) -> None:
        if self.hold_engine:
            self.held.extend(a for a in actions if isinstance(a, RunBatch))
            actions = [a for a in actions if not isinstance(a, RunBatch)]
        for action in self.harness.run(actions):
            if isinstance(action, Send) and action.stream_id == self.stream:
                self.client.receive_frame(action.response.SerializeToString())
            else:
                self.other.append(action)

    def release_held(self) -> None:
        held, self.held = self.held, []
        self.hold_engine = False
        self.feed(held)

    def pump(self) -> None:
        while bodies := self.client.requests_to_send(self.harness.now):
            for body in bodies:
                self.deliver(body)

    def lose_stream(self) -> None:
        self.feed(self.harness.stream_closed(self.stream, self.harness.now))
        self.client.stream_lost()


def make_client(
    shard_range: shard.ShardRange | None = None,
    route: dataplane.SessionRoute | None = None,
    session_id: str = "s1",
    epoch: int = 1,
    **kwargs: Any,
) -> SessionClient:
    return SessionClient(
        route_session_id=session_id,
        route_epoch=epoch,
        fingerprint=FP,
        shard_range=shard_range or srange(),
        route=route or make_route(),
        **kwargs,
    )


class Chain:
    """Head worker [0, split) forwarding to tail worker [split, LAYERS), as the asyncio edge will."""

    def __init__(self, split: int = 2, route_kwargs: dict | None = None) -> None:
        self.head = WorkerHarness(RecordingEngine(0, split))
        self.tail = WorkerHarness(RecordingEngine(split, LAYERS))
        self.hop = make_hop(NODE_B, split, LAYERS, split)
        self.route = make_route([self.hop], **(route_kwargs or {}))
        self.links: dict[SessionKey, Loopback] = {}
        # (session, next-hop client unit id) -> head unit id
        self.pending: dict[tuple[SessionKey, int], int] = {}
        self.forwards = 0
        self.head.downstream = self._downstream

    def _downstream(self, action: Action) -> list[Action]:
        if isinstance(action, Forward):
            self.forwards += 1
            link = self.links.get(action.session)
            if link is None:
                client = SessionClient(
                    route_session_id=action.session.session_id,
                    route_epoch=action.session.epoch,
                    fingerprint=FP,
                    shard_range=action.hop.shard_range,
                    route=action.route,
                )
                link = self.links[action.session] = Loopback(self.tail, client)
                link.connect()
            unit = link.client.submit_forward(action.work)
            self.pending[(action.session, unit)] = action.unit_id
            link.pump()
            return self._settle(action.session, link)
        return []

    def _settle(self, session: SessionKey, link: Loopback) -> list[Action]:
        out: list[Action] = []
        for event in link.client.take_events():
            if isinstance(event, UnitDone | UnitFailed):
                head_unit = self.pending.pop((session, event.unit_id))
                outcome = DownstreamResult(event.bundle) if isinstance(event, UnitDone) else event.error
                out.extend(self.head.downstream_finished(head_unit, outcome, self.head.now))
        return out


__all__ = [
    "FP",
    "HIDDEN",
    "NODE_B",
    "NOW",
    "SECOND",
    "UNIX_START",
    "Chain",
    "Loopback",
    "WorkerHarness",
    "acks",
    "chunk_request",
    "decode_request",
    "kinds",
    "make_client",
    "only_status",
    "open_request",
    "responses",
    "result_tokens",
    "srange",
    "statuses",
]
