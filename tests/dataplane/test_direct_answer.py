"""The tail answers the head directly (issue 20).

The head opens an answer stream to the route's tail (a SHARD_SESSION stream whose
SessionOpen sets ``answer_stream``); the tail sends the result chunk of every unit it
samples a token for there, and the Ack it sends back along the route says
``answered_directly`` instead of carrying the token; every hop passes the flag on.
Covered here: the tail's choice (answer stream open for the session's epoch or not),
what an answer stream refuses, a middle hop passing the flag on, the head's client
finishing a unit at whichever of answer and Ack comes first, and the driver over the
loopback mesh: tokens from the tail directly, identical to the whole model, also across
a killed middle hop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers.loopback_routes import (
    DRIVER_INDEX,
    FAST,
    MIDDLE,
    SPARE,
    TAIL,
    LoopbackRoutes,
    collect,
    three_hop_routes,
)
from helpers.loopback_routes import reference as whole_model
from helpers.polling import eventually
from helpers.recording_engine import LAYERS, RecordingEngine

from engines.interface import GREEDY
from meshnode.dataplane.actions import Action, Forward, Send
from meshnode.dataplane.client import ClientConfig, SessionClient, UnitDone, UnitFailed
from meshnode.dataplane.errors import SessionTransportError
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.worker import DownstreamResult
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import decode_bundle

from .harness import (
    NODE_B,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    kinds,
    make_client,
    only_status,
    open_request,
    reference,
    responses,
    result_tokens,
    srange,
)

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 3, 8, 1, 9, 2, 7]


def open_answer_stream(
    h: WorkerHarness, session_id: str = "s1", epoch: int = 1, **kwargs: Any
) -> tuple[int, list[shard.SessionResponse]]:
    """What a head sends to open its answer stream: an empty route, then SessionOpen(answer_stream)."""
    stream = h.worker.open_stream()
    actions = h.receive_frame(stream, make_route().SerializeToString(), h.now)
    request = open_request(session_id, epoch, **kwargs)
    request.open.answer_stream = True
    actions += h.receive_frame(stream, request.SerializeToString(), h.now)
    return stream, responses(h.run(actions), stream)


# ---------------------------------------------------------------------------- the tail


def test_the_tail_sends_its_token_on_the_answer_stream_and_acks_along_the_route():
    h = WorkerHarness()
    work, _ = h.open()
    answers, accepted = open_answer_stream(h)
    assert kinds(accepted) == ["accepted"]
    actions = h.send(work, chunk_request(1, PROMPT))
    upstream, direct = responses(actions, work), responses(actions, answers)
    assert kinds(upstream) == ["ack", "flow_control"] or kinds(upstream) == ["ack"]
    (ack,) = acks(upstream)
    assert ack.answered_directly and ack.cache_result.past_len == len(PROMPT)
    assert result_tokens(direct) == reference(PROMPT, 0)
    token = result_tokens(direct)[0]
    actions = h.send(work, decode_request(2, token, len(PROMPT)))
    assert result_tokens(responses(actions, answers)) == reference(PROMPT, 1)[1:]
    assert [a.answered_directly for a in acks(responses(actions, work))] == [True]
    assert h.worker.direct_answers == 2


def test_without_an_answer_stream_the_token_goes_back_along_the_route():
    h = WorkerHarness()
    work, _ = h.open()
    upstream = h.ask(work, chunk_request(1, PROMPT))
    assert result_tokens(upstream) == reference(PROMPT, 0)
    assert [a.answered_directly for a in acks(upstream)] == [False]
    assert h.worker.direct_answers == 0


def test_an_answer_stream_of_another_epoch_or_session_is_not_used():
    h = WorkerHarness()
    work, _ = h.open()
    open_answer_stream(h, epoch=2)
    open_answer_stream(h, session_id="s2")
    upstream = h.ask(work, chunk_request(1, PROMPT))
    assert result_tokens(upstream) == reference(PROMPT, 0)
    assert h.worker.direct_answers == 0


def test_once_the_answer_stream_is_gone_the_tail_answers_along_the_route_again():
    h = WorkerHarness()
    work, _ = h.open()
    answers, _ = open_answer_stream(h)
    first = h.send(work, chunk_request(1, PROMPT))
    token = result_tokens(responses(first, answers))[0]
    h.run(h.stream_closed(answers, h.now))
    upstream = h.ask(work, decode_request(2, token, len(PROMPT)))
    assert result_tokens(upstream) == reference(PROMPT, 1)[1:]
    assert [a.answered_directly for a in acks(upstream)] == [False]


def test_a_duplicate_step_is_answered_directly_again_from_the_replay_record():
    h = WorkerHarness()
    work, _ = h.open()
    answers, _ = open_answer_stream(h)
    h.send(work, chunk_request(1, PROMPT))
    calls = len(h.engine.calls)
    again = h.send(work, chunk_request(1, PROMPT))
    assert len(h.engine.calls) == calls  # not applied twice
    assert result_tokens(responses(again, answers)) == reference(PROMPT, 0)
    (ack,) = acks(responses(again, work))
    assert ack.duplicate and ack.answered_directly


def test_work_on_an_answer_stream_is_a_flow_control_violation():
    h = WorkerHarness()
    h.open()
    answers, _ = open_answer_stream(h)
    status = only_status(h.ask(answers, chunk_request(1, PROMPT)))
    assert status.terminal and status.error.code == shard.ERROR_CODE_FLOW_CONTROL_VIOLATION
    assert h.engine.calls == []


def test_only_the_tail_accepts_an_answer_stream():
    h = WorkerHarness(RecordingEngine(0, 2))
    _, refused = open_answer_stream(h, shard_range=srange(0, 2))
    status = only_status(refused)
    assert status.terminal and status.error.code == shard.ERROR_CODE_SHARD_RANGE_MISMATCH


def test_an_answer_stream_holds_no_session():
    h = WorkerHarness()
    open_answer_stream(h)
    assert h.worker.load().active_sessions == 0


# ---------------------------------------------------------------------------- a middle hop


def test_a_middle_hop_passes_the_direct_answer_on_in_its_own_ack():
    h = WorkerHarness(RecordingEngine(0, 2))
    route = make_route([make_hop(NODE_B, 2, LAYERS, 2)])
    work, _ = h.open(route, shard_range=srange(0, 2))
    actions = h.send(work, chunk_request(1, PROMPT, shard_range=srange(0, 2)))
    (forward,) = [a for a in actions if isinstance(a, Forward)]
    outcome = DownstreamResult(None, answered_directly=True)
    upstream = responses(h.run(h.downstream_finished(forward.unit_id, outcome, h.now)), work)
    assert "chunk" not in kinds(upstream)
    assert [a.answered_directly for a in acks(upstream)] == [True]


# ---------------------------------------------------------------------------- the head's client


class AnsweredSession:
    """A head's client toward a tail worker over serialized frames, with its answer stream; the
    test decides whether the tail's answers or its Acks reach the client first."""

    def __init__(self) -> None:
        self.h = WorkerHarness()
        self.client: SessionClient = make_client(config=_direct_config())
        self.work = self.h.worker.open_stream()
        self.answers = self.h.worker.open_stream()
        for body in self.client.start_stream():
            self._deliver_work(body)
        held: list[Action] = []
        for body in self.client.answer_stream_start(srange()):
            held += self.h.run(self.h.receive_frame(self.answers, body, self.h.now))
        self.route(held)
        self.client.take_events()  # SessionReady

    def _deliver_work(self, body: bytes) -> None:
        self.route(self.h.run(self.h.receive_frame(self.work, body, self.h.now)))

    def route(self, actions: list[Action], *, answers_first: bool = True, drop_answers: bool = False) -> None:
        sends = [a for a in actions if isinstance(a, Send)]
        direct = [a for a in sends if a.stream_id == self.answers]
        upstream = [a for a in sends if a.stream_id == self.work]
        if drop_answers:
            direct = []
        order = [*direct, *upstream] if answers_first else [*upstream, *direct]
        for send in order:
            body = send.response.SerializeToString()
            if send.stream_id == self.answers:
                self.client.receive_answer_frame(body)
            else:
                self.client.receive_frame(body)

    def send(self, *, answers_first: bool = True, drop_answers: bool = False) -> None:
        for body in self.client.requests_to_send(self.h.now):
            actions = self.h.run(self.h.receive_frame(self.work, body, self.h.now))
            self.route(actions, answers_first=answers_first, drop_answers=drop_answers)


def _direct_config() -> ClientConfig:
    return ClientConfig(direct_answers=True)


def _token(event: UnitDone) -> int:
    assert event.bundle is not None
    return int(decode_bundle(event.bundle)["token_ids"].array[0])


def test_the_head_is_done_at_the_direct_answer_and_the_later_ack_returns_the_credit():
    s = AnsweredSession()
    s.client.submit_prefill(PROMPT)
    s.send(answers_first=True)
    (done,) = [e for e in s.client.take_events() if isinstance(e, UnitDone)]
    assert done.answered_directly and _token(done) == reference(PROMPT, 0)[0]
    assert s.client.unacked == 0 and s.client.outstanding == 0


def test_an_ack_ahead_of_the_direct_answer_leaves_the_unit_owed_until_it_comes():
    s = AnsweredSession()
    s.client.submit_prefill(PROMPT)
    s.send(answers_first=False)
    done = [e for e in s.client.take_events() if isinstance(e, UnitDone)]
    assert len(done) == 1 and _token(done[0]) == reference(PROMPT, 0)[0]
    # The Ack came first: done only once the answer arrived, with the Ack's cache position.
    assert done[0].cache_result.past_len == len(PROMPT)


def test_a_lost_answer_stream_fails_the_units_owed_a_direct_answer():
    s = AnsweredSession()
    s.client.submit_prefill(PROMPT)
    s.send(drop_answers=True)
    assert [e for e in s.client.take_events() if isinstance(e, UnitDone)] == []
    assert s.client.outstanding == 1
    s.client.answers_lost()
    (failed,) = s.client.take_events()
    assert isinstance(failed, UnitFailed) and isinstance(failed.error, SessionTransportError)


def test_a_unit_answered_directly_is_not_sent_again_after_the_work_stream_is_lost():
    s = AnsweredSession()
    s.client.submit_prefill(PROMPT)
    bodies = s.client.requests_to_send(s.h.now)
    actions = s.h.run(s.h.receive_frame(s.work, bodies[0], s.h.now))
    direct = [a for a in actions if isinstance(a, Send) and a.stream_id == s.answers]
    for send in direct:  # the answer arrives; the Ack is lost with the stream
        s.client.receive_answer_frame(send.response.SerializeToString())
    assert [type(e) for e in s.client.take_events()] == [UnitDone]
    s.client.stream_lost()
    s.client.start_stream()
    assert s.client.pending == 0 and s.client.outstanding == 0


def test_a_forwarding_hops_client_reports_an_ack_that_says_the_answer_went_direct():
    h = WorkerHarness()
    answers = h.worker.open_stream()
    client = make_client()  # no answer stream of its own: it passes the word on
    for body in client.answer_stream_start(srange()):
        h.run(h.receive_frame(answers, body, h.now))
    work = h.worker.open_stream()
    for body in client.start_stream():
        for action in h.run(h.receive_frame(work, body, h.now)):
            if isinstance(action, Send) and action.stream_id == work:
                client.receive_frame(action.response.SerializeToString())
    client.submit_prefill(PROMPT)
    for body in client.requests_to_send(h.now):
        for action in h.run(h.receive_frame(work, body, h.now)):
            if isinstance(action, Send) and action.stream_id == work:
                client.receive_frame(action.response.SerializeToString())
    (done,) = [e for e in client.take_events() if isinstance(e, UnitDone)]
    assert done.answered_directly and done.bundle is None


# ---------------------------------------------------------------------------- the driver, end to end


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes() as routes:
        yield routes


def direct_answers(routes: LoopbackRoutes, index: int) -> int:
    return routes.shards[index].server.worker.direct_answers


async def test_the_driver_gets_every_decoded_token_straight_from_the_tail(routes):
    driver = GenerationDriver(routes, FAST)
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 12))
    assert tokens == whole_model(PROMPT, 12)
    # The prefill's token may beat the answer stream to the tail; every decoded one goes direct.
    assert direct_answers(routes, TAIL) >= 11
    assert direct_answers(routes, MIDDLE) == 0
    await eventually(lambda: all(s.server.load().active_sessions == 0 for s in routes.shards.values()))
    # The end of the generation waited for the last token's Acks to come back along the route:
    # its release cancelled nothing on the way.
    assert [dict(s.server.errors_sent) for s in routes.shards.values()] == [{}, {}, {}]


async def test_with_the_direct_answer_off_the_tokens_are_the_same_and_come_along_the_route(routes):
    driver = GenerationDriver(routes, DriverConfig(**{**FAST.__dict__, "direct_answer": False}))
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 12))
    assert tokens == whole_model(PROMPT, 12)
    assert direct_answers(routes, TAIL) == 0


async def test_the_direct_answer_survives_a_killed_middle_hop_with_identical_tokens(routes):
    await routes.add_shard(SPARE, 2, 3)
    sampling = GREEDY
    expected = whole_model(PROMPT, 16, sampling)
    driver = GenerationDriver(routes, FAST)
    killed: list[bytes] = []
    direct_before_kill = 0

    stream = driver.generate(routes.model, PROMPT, sampling, 16)

    async def kill_the_middle_after_six(count: int) -> None:
        nonlocal direct_before_kill
        if count == 6:
            assert stream.route is not None
            middle_id = stream.route.hops[1].node_id
            (middle,) = [s for s in routes.shards.values() if s.node_id == middle_id]
            killed.append(middle_id)
            direct_before_kill = direct_answers(routes, TAIL)
            middle.peer.kill()  # like SIGKILL: its links close, nothing more is accepted

    tokens = await collect(stream, on_token=kill_the_middle_after_six)
    assert tokens == expected
    assert killed and driver.stats.reroutes == 1 and driver.stats.replay_mismatches == 0
    # After the failover the new epoch's answer stream carries the tokens again: the replay's and
    # the rest of the generation's decoded ones.
    assert direct_answers(routes, TAIL) - direct_before_kill >= 16 - 6 - 1
    await eventually(
        lambda: all(
            s.server.load().active_sessions == 0 for s in routes.shards.values() if s.node_id not in killed
        )
    )


async def test_a_refused_answer_stream_leaves_the_tokens_coming_along_the_route(routes):
    from meshnode.dataplane.edges.shard_session import DirectAnswers, ShardSession
    from meshnode.dataplane.route import make_hop as hop

    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    fingerprint = routes.shards[DRIVER_INDEX].server.worker.fingerprint
    # Asked of the middle hop, which is no tail: it refuses, and is not asked again.
    answers = DirectAnswers(links=lambda: routes.link(middle.node_id), tail_range=srange(2, 3))
    async with ShardSession.open(
        lambda: routes.link(routes.me.node_id),
        fingerprint=fingerprint,
        shard_range=srange(0, 2),
        downstream=[hop(middle.node_id, 2, 3, 2), hop(tail.node_id, 3, 4, 3)],
        answers=answers,
    ) as session:
        assert not await session.answers_ready()
        tokens = [(await session.prefill(PROMPT)).token]
        for position in range(len(PROMPT), len(PROMPT) + 4):
            output = await session.decode(tokens[-1], position=position)
            assert not output.done.answered_directly
            tokens.append(output.token)
    assert tokens == whole_model(PROMPT, 5)
    assert direct_answers(routes, TAIL) == 0
    assert middle.server.errors_sent[shard.ERROR_CODE_SHARD_RANGE_MISMATCH] == 1
