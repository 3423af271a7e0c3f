"""Continuous batching at a shard's worker, on the fake engine: which units share an engine
batch, what each one's answer is, how one unit's fate leaves the others', and the counts
behind ``/metrics``.

A batch forms when the engine is free, from the units queued by then: a unit that
arrives while a batch runs waits for the next one. So the tests hold a batch (the
actions are taken from the worker, not carried out), queue the units under test behind
it, and then let the edge run, asserting the exact membership of every batch the engine
saw (``RecordingEngine.batches``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from helpers.recording_engine import RecordingEngine
from prometheus_client.parser import text_string_to_metric_families

from engines.interface import EngineHealth
from meshnode.dataplane.actions import Action, FireCancel, Forward, RunBatch
from meshnode.dataplane.batching import BatchLimits
from meshnode.dataplane.errors import ENGINE_FAILURE_DETAIL
from meshnode.dataplane.lease import LOCAL_ORIGIN, StreamOrigin
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.dataplane.worker import WorkerConfig, WorkerLoad
from meshnode.metrics import MetricSources, collect, render, samples_by_name
from meshnode.wire.pb import shard

from .harness import (
    NODE_B,
    SECOND,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    kinds,
    only_status,
    reference,
    responses,
    result_tokens,
    srange,
    statuses,
)

MS = SECOND // 1000
PEER_A = StreamOrigin(b"\x0a" * 32, local=False)
PEER_B = StreamOrigin(b"\x0b" * 32, local=False)


@dataclass
class Live:
    """One open session: its stream, the next step and position, and the last token it got."""

    session_id: str
    stream: int
    step: int
    position: int
    token: int

    def decode(self, *, deadline: int = 0, token: int | None = None) -> shard.SessionRequest:
        request = decode_request(
            self.step, self.token if token is None else token, self.position, deadline=deadline
        )
        self.step += 1
        self.position += 1
        return request


def harness_for(
    *, max_sessions: int = 4, limits: BatchLimits | None = None, hold_share: float = 1.0
) -> WorkerHarness:
    config = WorkerConfig(batch_limits=limits, batch_hold_share=hold_share)
    return WorkerHarness(RecordingEngine(max_sessions=max_sessions), config)


def open_prefilled(
    harness: WorkerHarness, session_id: str, prompt: list[int], origin: StreamOrigin = LOCAL_ORIGIN
) -> Live:
    stream, _ = harness.open(session_id=session_id, origin=origin)
    (token,) = result_tokens(harness.ask(stream, chunk_request(1, prompt, session_id=session_id)))
    return Live(session_id, stream, 2, len(prompt), token)


def membership(harness: WorkerHarness, since: int) -> list[list[tuple[str, bool]]]:
    """The batches the engine ran after the first ``since``: (session, decode) per step."""
    return [
        [(step.request.session.session_id, step.decode) for step in batch]
        for batch in harness.engine.batches[since:]
    ]


def batch_of(actions: list[Action]) -> RunBatch:
    (batch,) = [a for a in actions if isinstance(a, RunBatch)]
    return batch


def without_batches(actions: list[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, RunBatch)]


def queue_behind_a_running_batch(
    harness: WorkerHarness, first: Live, others: list[tuple[Live, shard.SessionRequest]]
) -> RunBatch:
    """Start ``first``'s decode alone, queue the others' requests behind it, run the first
    batch, and return the next one, formed but not run (its sessions' answers not yet in)."""
    first_batch = batch_of(harness.send(first.stream, first.decode(), run=False))
    for live, request in others:
        queued = harness.send(live.stream, request, run=False)
        assert [a for a in queued if isinstance(a, RunBatch)] == []
    finished = harness.batch_finished(first_batch.batch_id, first_batch.execute(harness.engine), harness.now)
    harness.run(without_batches(finished))
    return batch_of(finished)


# ---------------------------------------------------------------------------- one batch, many sessions


def test_ready_decodes_of_several_sessions_run_in_one_batch_each_with_its_own_answer() -> None:
    harness = harness_for()
    prompts = {"a": [1, 2, 3], "b": [9, 8, 7, 6], "c": [5]}
    lives = {name: open_prefilled(harness, name, prompt) for name, prompt in prompts.items()}
    # A fourth session's decode holds the engine while the three queue behind it.
    blocker = open_prefilled(harness, "z", [4, 4])
    tokens = {name: [live.token] for name, live in lives.items()}
    since = len(harness.engine.batches)
    for _ in range(3):
        actions = harness.send(blocker.stream, blocker.decode(token=1), run=False)
        for live in lives.values():
            actions += harness.send(live.stream, live.decode(), run=False)
        out = harness.run(actions)
        for name, live in lives.items():
            answer = responses(out, live.stream)
            assert kinds(answer)[:2] == ["chunk", "ack"]
            (live.token,) = result_tokens(answer)
            tokens[name].append(live.token)
    together = [("a", True), ("b", True), ("c", True)]
    assert membership(harness, since) == [[("z", True)], together] * 3
    # Each session's tokens are exactly what the model gives it run alone.
    assert tokens == {name: reference(prompt, 3) for name, prompt in prompts.items()}


def test_a_batch_takes_one_unit_per_session_and_the_next_ones_follow_in_order() -> None:
    harness = harness_for()
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [4, 5])
    since = len(harness.engine.batches)
    actions = harness.send(a.stream, a.decode(token=1), run=False)
    actions += harness.send(a.stream, a.decode(token=2), run=False)
    actions += harness.send(a.stream, a.decode(token=3), run=False)
    actions += harness.send(b.stream, b.decode(token=4), run=False)
    out = harness.run(actions)
    assert membership(harness, since) == [[("a", True)], [("a", True), ("b", True)], [("a", True)]]
    assert [ack.idempotency_step for ack in acks(responses(out, a.stream))] == [2, 3, 4]
    assert [ack.idempotency_step for ack in acks(responses(out, b.stream))] == [2]


# ---------------------------------------------------------------------------- prefill interleaving


def chunked_prompt(live_id: str, chunks: int, size: int, first_step: int = 1) -> list[shard.SessionRequest]:
    return [
        chunk_request(
            first_step + i,
            list(range(10 + i * size, 10 + (i + 1) * size)),
            first_position=i * size,
            chunk=(i, chunks),
            session_id=live_id,
        )
        for i in range(chunks)
    ]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        # A chunk fills a batch's tokens: the decode runs between two chunks, never behind two.
        (
            BatchLimits(max_units=4, max_tokens=4),
            [["d"], ["p"], ["d"], ["p"], ["d"], ["p"], ["p"]],
        ),
        # Room for both: every chunk carries the waiting decode along.
        (
            BatchLimits(max_units=4, max_tokens=16),
            [["d"], ["p", "d"], ["p", "d"], ["p"], ["p"]],
        ),
    ],
)
def test_a_long_prompt_never_delays_another_sessions_decode_by_more_than_one_chunk(
    limits: BatchLimits, expected: list[list[str]]
) -> None:
    harness = harness_for(limits=limits)
    d = open_prefilled(harness, "d", [1, 2, 3])
    p_stream, _ = harness.open(session_id="p")
    since = len(harness.engine.batches)
    actions = harness.send(d.stream, d.decode(token=5), run=False)
    for request in chunked_prompt("p", 4, 4):
        actions += harness.send(p_stream, request, run=False)
    for _ in range(2):
        actions += harness.send(d.stream, d.decode(token=5), run=False)
    out = harness.run(actions)
    assert [[session for session, _ in batch] for batch in membership(harness, since)] == expected
    assert [ack.idempotency_step for ack in acks(responses(out, d.stream))] == [2, 3, 4]
    assert [ack.idempotency_step for ack in acks(responses(out, p_stream))] == [1, 2, 3, 4]
    # The chunked prompt's token is the model's for the whole prompt run alone.
    assert result_tokens(responses(out, p_stream)) == reference(list(range(10, 26)), 0)


# ---------------------------------------------------------------------------- fairness


def test_a_lone_session_gets_a_turn_every_round_beside_an_owner_with_six() -> None:
    harness = harness_for(max_sessions=8, limits=BatchLimits(max_units=2, max_tokens=64))
    many = [open_prefilled(harness, f"a{i}", [1, 2, 3], PEER_A) for i in range(1, 7)]
    lone = open_prefilled(harness, "b", [1, 2, 3], PEER_B)
    since = len(harness.engine.batches)
    actions: list[Action] = []
    for _ in range(3):  # three decodes queued per session, more than a batch has room for
        for live in [*many, lone]:
            actions += harness.send(live.stream, live.decode(token=4), run=False)
    out = harness.run(actions)
    batches = [[session for session, _ in batch] for batch in membership(harness, since)]
    # a1's first decode found the engine free; then every batch has b until its three ran.
    assert batches[:4] == [["a1"], ["a2", "b"], ["a3", "b"], ["a4", "b"]]
    assert all("b" not in batch for batch in batches[4:])
    assert Counter(session for batch in batches for session in batch) == Counter(
        {**{f"a{i}": 3 for i in range(1, 7)}, "b": 3}
    )
    assert all(len(batch) <= 2 for batch in batches)
    for live in [*many, lone]:
        assert [ack.idempotency_step for ack in acks(responses(out, live.stream))] == [2, 3, 4]


def test_a_hop_forwards_each_result_at_once_and_starts_the_next_batch_without_waiting_downstream() -> None:
    harness = WorkerHarness(RecordingEngine(0, 2))  # no next-hop answer ever comes back here
    route = make_route([make_hop(NODE_B, 2, 4, 2)])
    streams = {}
    for name in "abc":
        streams[name], _ = harness.open(route, session_id=name, shard_range=srange(0, 2))
    actions = []
    for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6])):
        request = chunk_request(1, prompt, session_id=name, shard_range=srange(0, 2))
        actions += harness.send(streams[name], request, run=False)
    for name, position in (("a", 3), ("b", 2), ("c", 1)):
        actions += harness.send(streams[name], decode_request(2, 7, position), run=False)
    out = harness.run(actions)

    def sessions(action: Action) -> tuple[str, ...]:
        if isinstance(action, RunBatch):
            return tuple(step.request.session.session_id for step in action.steps)
        assert isinstance(action, Forward)
        return (action.session.session_id,)

    order = [(type(a).__name__, sessions(a)) for a in harness.log if isinstance(a, RunBatch | Forward)]
    # One prefill chunk a batch, the decodes riding along; each result goes on as its batch ends.
    assert order == [
        ("RunBatch", ("a",)),
        ("Forward", ("a",)),
        ("RunBatch", ("b", "a")),
        ("Forward", ("b",)),
        ("Forward", ("a",)),
        ("RunBatch", ("c", "b")),
        ("Forward", ("c",)),
        ("Forward", ("b",)),
        ("RunBatch", ("c",)),
        ("Forward", ("c",)),
    ]
    assert acks(responses(out)) == []  # nobody is answered before the next hop is


# ---------------------------------------------------------------------------- one unit's fate


def test_a_unit_cancelled_inside_a_running_batch_is_cancelled_and_the_others_succeed() -> None:
    harness = harness_for()
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [7, 7])
    c = open_prefilled(harness, "c", [3, 1, 4, 1])
    running = queue_behind_a_running_batch(harness, a, [(b, b.decode()), (c, c.decode())])
    assert [step.request.session.session_id for step in running.steps] == ["b", "c"]
    b_token, c_token = (step.request.cancel_token for step in running.steps)

    cancel = shard.SessionRequest(cancel=shard.CancelSignal(route_session_id="b", route_epoch=1))
    actions = harness.send(b.stream, cancel, run=False)
    assert [x.token for x in actions if isinstance(x, FireCancel)] == [b_token]
    status = only_status(responses(actions, b.stream))
    assert status.idempotency_step == 2
    assert status.error.code == shard.ERROR_CODE_CANCELLED and not status.error.retryable
    harness.run(actions)
    assert b_token is not None and b_token.cancelled
    assert c_token is not None and not c_token.cancelled

    out = harness.run([running])
    assert responses(out, b.stream) == []  # answered once, by the cancel
    answer = responses(out, c.stream)
    assert kinds(answer)[:2] == ["chunk", "ack"]
    assert result_tokens(answer) == reference([3, 1, 4, 1], 1)[1:]
    # b's step was not applied: the same step runs again and gives the model's token.
    (retried,) = result_tokens(harness.ask(b.stream, decode_request(2, b.token, 2, work_id="w2-again")))
    assert retried == reference([7, 7], 1)[1]


def test_a_deadline_inside_a_running_batch_fires_only_that_units_token() -> None:
    harness = harness_for()
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [7, 7])
    c = open_prefilled(harness, "c", [5, 5])
    deadline = harness.unix_now + SECOND
    running = queue_behind_a_running_batch(harness, a, [(b, b.decode(deadline=deadline)), (c, c.decode())])
    b_token, c_token = (step.request.cancel_token for step in running.steps)
    actions = harness.handle_timer(harness.now + SECOND)
    assert [x.token for x in actions if isinstance(x, FireCancel)] == [b_token]
    assert only_status(responses(actions, b.stream)).error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
    assert responses(actions, c.stream) == []
    harness.run(actions)
    assert kinds(responses(harness.run([running]), c.stream))[:2] == ["chunk", "ack"]
    assert c_token is not None and not c_token.cancelled


def test_a_batch_failing_as_a_whole_fails_each_of_its_units_like_an_engine_failure() -> None:
    harness = harness_for()
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [7, 7])
    c = open_prefilled(harness, "c", [5, 5])
    running = queue_behind_a_running_batch(harness, a, [(b, b.decode()), (c, c.decode())])
    harness.engine.fail_next = RuntimeError("engine crashed reading /models/secret.gguf")
    out = harness.run([running])
    for live in (b, c):
        status = only_status(responses(out, live.stream))
        assert status.idempotency_step == 2
        assert status.error.code == shard.ERROR_CODE_INTERNAL and not status.error.retryable
        assert status.error.detail == ENGINE_FAILURE_DETAIL
    # Nothing was applied and the worker keeps serving: the step runs again.
    assert kinds(harness.ask(b.stream, decode_request(2, b.token, 2)))[:2] == ["chunk", "ack"]


def test_an_engine_answering_the_wrong_number_of_outcomes_fails_the_whole_batch() -> None:
    harness = harness_for()
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [7, 7])
    c = open_prefilled(harness, "c", [5, 5])
    running = queue_behind_a_running_batch(harness, a, [(b, b.decode()), (c, c.decode())])
    (only_one,) = running.execute(harness.engine)[:1]
    out = harness.batch_finished(running.batch_id, [only_one], harness.now)
    assert [status.error.code for status in statuses(responses(out))] == [shard.ERROR_CODE_INTERNAL] * 2


def test_a_unit_whose_deadline_passed_before_its_batch_started_is_refused_and_takes_no_room() -> None:
    harness = harness_for(limits=BatchLimits(max_units=1, max_tokens=64))
    a = open_prefilled(harness, "a", [1, 2, 3])
    b = open_prefilled(harness, "b", [7, 7])
    c = open_prefilled(harness, "c", [5, 5])
    since = len(harness.engine.batches)
    first = batch_of(harness.send(a.stream, a.decode(), run=False))
    harness.send(b.stream, b.decode(deadline=harness.unix_now + SECOND), run=False)
    harness.send(c.stream, c.decode(), run=False)
    harness.now += 2 * SECOND  # the first batch ran long; no timer fired meanwhile
    out = harness.run([first])
    status = only_status(responses(out, b.stream))
    assert status.error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED and not status.error.retryable
    assert kinds(responses(out, c.stream))[:2] == ["chunk", "ack"]
    # b took no room: c ran in the batch right after a's, alone as the limit allows.
    assert membership(harness, since) == [[("a", True)], [("c", True)]]


# ---------------------------------------------------------------------------- metrics


class _Server:
    """What ``meshnode.metrics.collect`` reads of a shard server, around a harness's worker."""

    def __init__(self, harness: WorkerHarness) -> None:
        self.worker = harness.worker
        self.engine = harness.engine
        self.errors_sent: Counter[int] = Counter()

    def load(self) -> WorkerLoad:
        return self.worker.load()

    async def engine_health(self) -> EngineHealth:
        return self.engine.health()


def metric_samples(text: str, *names: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples named ``names`` in an exposition, parsed with prometheus_client's parser."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    ]


async def test_batch_sizes_queue_waits_and_busy_time_after_known_batches() -> None:
    # No waiting for sessions due back: the batches here are the ones the test lays out.
    harness = harness_for(hold_share=0)
    a, b, c = (open_prefilled(harness, name, [1, 2, 3]) for name in "abc")  # three 3-token batches
    stats = harness.worker.batch_stats
    t0 = harness.now
    first = batch_of(harness.send(a.stream, a.decode(), run=False))  # starts at t0, waits 0
    harness.now = t0 + 3 * MS
    harness.send(b.stream, b.decode(), run=False)
    harness.send(c.stream, c.decode(), run=False)
    assert harness.worker.load().running_units == 1 and harness.worker.load().queued_units == 2
    harness.now = t0 + 10 * MS  # a's batch took 10 ms; b and c waited 7 ms for theirs
    second = batch_of(harness.batch_finished(first.batch_id, first.execute(harness.engine), harness.now))
    assert harness.worker.load().running_units == 2
    assert stats.busy_ns_at(t0 + 12 * MS) == 12 * MS  # the running batch's time so far counts
    harness.now = t0 + 15 * MS
    harness.run(harness.batch_finished(second.batch_id, second.execute(harness.engine), harness.now))

    assert (stats.batches, stats.decode_units, stats.prefill_units, stats.tokens) == (5, 3, 3, 12)
    assert stats.busy_ns == 15 * MS
    # The announced speed: a's lone decode took 10 ms, then b's and c's shared 5 ms (5 ms per
    # token for each), smoothed: 10 + 0.1 * (5 - 10) = 9.5 ms. The prefills took no time on the
    # harness's clock, so none is measured.
    assert stats.speed.speed() == StageSpeed(
        decode_us_per_token=9_500, prefill_us_per_token=0, samples=2, measured=True
    )
    sources = MetricSources(server=_Server(harness))
    text = render(await collect(sources, now=harness.now / SECOND))
    assert metric_samples(text, "meshnode_stage_seconds_per_token", "meshnode_stage_speed_samples") == [
        ("meshnode_stage_seconds_per_token", {"kind": "decode", "source": "measured"}, 0.0095),
        ("meshnode_stage_seconds_per_token", {"kind": "prefill", "source": "measured"}, 0.0),
        ("meshnode_stage_speed_samples", {}, 2),
    ]
    assert metric_samples(text, "meshnode_batches_total", "meshnode_batch_units_total") == [
        ("meshnode_batches_total", {}, 5),
        ("meshnode_batch_units_total", {"kind": "decode"}, 3),
        ("meshnode_batch_units_total", {"kind": "prefill"}, 3),
    ]
    sizes = metric_samples(
        text, "meshnode_batch_size_bucket", "meshnode_batch_size_sum", "meshnode_batch_size_count"
    )
    assert sizes == [
        *(
            ("meshnode_batch_size_bucket", {"le": le}, count)
            for le, count in [
                ("1.0", 4),
                ("2.0", 5),
                ("4.0", 5),
                ("8.0", 5),
                ("16.0", 5),
                ("32.0", 5),
                ("64.0", 5),
                ("+Inf", 5),
            ]
        ),
        ("meshnode_batch_size_count", {}, 5),
        ("meshnode_batch_size_sum", {}, 6),
    ]
    waits = metric_samples(text, "meshnode_queue_wait_seconds_bucket", "meshnode_queue_wait_seconds_count")
    assert waits[:4] == [
        ("meshnode_queue_wait_seconds_bucket", {"le": le}, count)
        for le, count in [("0.001", 4), ("0.005", 4), ("0.01", 6), ("0.025", 6)]
    ]
    assert waits[-1] == ("meshnode_queue_wait_seconds_count", {}, 6)
    assert stats.queue_wait_s.total == pytest.approx(0.014)
    assert "# TYPE meshnode_batch_size histogram" in text.splitlines()
    ((_, _, busy_seconds),) = metric_samples(text, "meshnode_engine_busy_seconds_total")
    assert busy_seconds == pytest.approx(0.015)
    # Every batch so far fell within the last 10 s: busy 15 ms of the time since the first began.
    assert stats.first_started_ns is not None
    since_first = harness.now - stats.first_started_ns
    assert since_first >= 15 * MS
    ((_, _, busy_fraction),) = metric_samples(text, "meshnode_engine_busy_fraction")
    assert busy_fraction == pytest.approx(15 * MS / since_first)

    # 20 s later, a 5 ms batch: of the trailing 10 s window the engine was busy 5 ms, and a
    # second scraper reads the same share as the first.
    later = harness.now + 20 * SECOND
    harness.now = later - 5 * MS
    third = batch_of(harness.send(a.stream, a.decode(), run=False))
    harness.now = later
    harness.run(harness.batch_finished(third.batch_id, third.execute(harness.engine), harness.now))
    for _ in range(2):
        samples = samples_by_name(await collect(sources, now=harness.now / SECOND))
        assert samples["meshnode_engine_busy_fraction"] == [({}, pytest.approx(5 * MS / (10 * SECOND)))]
    assert samples["meshnode_engine_busy_seconds_total"] == [({}, pytest.approx(0.020))]


# ---------------------------------------------------------------------------- sessions due back


def two_out_of_step(harness: WorkerHarness) -> tuple[Live, Live, RunBatch]:
    """a's decode running alone with b's queued behind it: the pattern that, left alone, repeats
    for ever (b alone while a's next step comes back, then a alone, ...). Both answered their
    prefills and sent their next unit at once, so each is learnt to come back with no delay."""
    a, b = open_prefilled(harness, "a", [1, 2, 3]), open_prefilled(harness, "b", [4, 5])
    first = batch_of(harness.send(a.stream, a.decode(), run=False))
    harness.now += 2 * MS
    assert batch_of_none(harness.send(b.stream, b.decode(), run=False))
    return a, b, first


def batch_of_none(actions: list[Action]) -> bool:
    return not [a for a in actions if isinstance(a, RunBatch)]


def test_the_free_engine_waits_for_a_session_due_back_and_both_share_the_next_batch() -> None:
    harness = harness_for()
    a, _, first = two_out_of_step(harness)
    harness.now += 8 * MS  # a's batch took 10 ms
    finished = harness.batch_finished(first.batch_id, first.execute(harness.engine), harness.now)
    # b is ready, but a is due back at once: the engine waits instead of running b alone...
    assert batch_of_none(finished)
    harness.run(finished)
    timer = harness.worker.get_timer()
    assert timer is not None and harness.now < timer <= harness.now + 10 * MS
    # ... and a's next step, arriving within the wait, rides with b's.
    harness.now += 100_000
    together = batch_of(harness.send(a.stream, a.decode(), run=False))
    assert sorted(step.request.session.session_id for step in together.steps) == ["a", "b"]


def test_a_session_that_does_not_come_back_costs_one_wait_and_is_not_waited_for_again() -> None:
    harness = harness_for()
    _, b, first = two_out_of_step(harness)
    harness.now += 8 * MS
    harness.run(harness.batch_finished(first.batch_id, first.execute(harness.engine), harness.now))
    timer = harness.worker.get_timer()
    assert timer is not None and timer <= harness.now + 10 * MS
    # a stays away: at the wait's end b runs alone.
    harness.now = timer
    alone = batch_of(harness.handle_timer(harness.now))
    assert [step.request.session.session_id for step in alone.steps] == ["b"]
    harness.now += 10 * MS
    finished = harness.batch_finished(alone.batch_id, alone.execute(harness.engine), harness.now)
    harness.run(finished)
    # b's next step arrives later than b was learnt to; a, late now, is not waited for.
    harness.now += 5 * MS
    next_alone = batch_of(harness.send(b.stream, b.decode(), run=False))
    assert [step.request.session.session_id for step in next_alone.steps] == ["b"]


def test_with_waiting_off_the_free_engine_runs_whatever_is_ready() -> None:
    harness = harness_for(hold_share=0)
    _, _, first = two_out_of_step(harness)
    harness.now += 8 * MS
    alone = batch_of(harness.batch_finished(first.batch_id, first.execute(harness.engine), harness.now))
    assert [step.request.session.session_id for step in alone.steps] == ["b"]
