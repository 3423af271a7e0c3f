"""Pipeline cohorts at a shard's worker (meshnode.dataplane.cohorts): when a head says its route
has S stages, the worker runs those sessions at most floor(sessions / S) a batch (one at
least: as many cohorts as stages or more), in the
scheduler's fair order, so that the others can compute at the other stages meanwhile; without
it every ready session shares one batch (the convoy), as before."""

from __future__ import annotations

from helpers.recording_engine import RecordingEngine

from meshnode.dataplane.actions import RunBatch
from meshnode.dataplane.batching import BatchLimits, BatchScheduler
from meshnode.dataplane.cohorts import cohort_limit
from meshnode.dataplane.route import MAX_ROUTE_HOPS, make_hop, make_route, validate_route
from meshnode.dataplane.worker import WorkerConfig

from .harness import NODE_B, WorkerHarness, chunk_request, decode_request, reference, responses, result_tokens


def test_no_session_asking_for_cohorts_leaves_the_batch_unbounded() -> None:
    assert cohort_limit([]) is None
    assert cohort_limit([0, 0, 1]) is None


def test_the_sessions_asking_make_at_least_as_many_cohorts_as_stages() -> None:
    assert cohort_limit([3, 3, 3]) == 1
    # Four on three stages: four cohorts of one, not two of two (a stage would always idle).
    assert cohort_limit([3, 3, 3, 3]) == 1
    assert cohort_limit([3] * 6) == 2
    assert cohort_limit([2, 2, 2, 2, 2]) == 2
    # One session asking: a cohort of one, whatever the stages.
    assert cohort_limit([4]) == 1
    # Every session held takes a place, shared out over the most stages any route has.
    assert cohort_limit([0, 3, 3, 0, 0]) == 1
    assert cohort_limit([0, 3, 0, 0, 0, 0]) == 2
    assert cohort_limit([2, 4, 4, 2, 2, 2, 4, 4]) == 2


def test_a_plan_takes_at_most_its_cohort_and_the_next_plan_the_sessions_left_out() -> None:
    scheduler = BatchScheduler(BatchLimits(max_units=8, max_tokens=64))
    for session_id in "abcd":
        scheduler.file(session_id, "owner", decode=True, tokens=1)

    def formed(max_units: int) -> list[str]:
        plan = scheduler.plan(max_units=max_units)
        taken = []
        while (session_id := plan.next()) is not None:
            plan.accept(session_id)
            taken.append(session_id)
        return taken

    assert formed(2) == ["a", "b"]
    assert formed(2) == ["c", "d"]
    assert formed(3) == ["a", "b", "c"]
    # A cohort larger than the engine's limit is the engine's limit.
    assert BatchScheduler(BatchLimits(max_units=3, max_tokens=64)).plan(max_units=10).max_units == 3


def test_the_stage_count_travels_unchanged_to_every_hop() -> None:
    route = make_route([make_hop(NODE_B, 2, 3, 2), make_hop(NODE_B, 3, 4, 3)], pipeline_stages=3)
    plan = validate_route(route, end_layer=2, is_tail=False)
    assert plan.pipeline_stages == 3
    assert plan.onward is not None
    onward = validate_route(plan.onward, end_layer=3, is_tail=False)
    assert onward.pipeline_stages == 3
    assert validate_route(make_route(pipeline_stages=MAX_ROUTE_HOPS + 1), end_layer=4, is_tail=True)


def decodes_of_three_sessions(pipeline_stages: int) -> tuple[list[list[str]], dict[str, list[int]]]:
    """Three prefilled sessions opened with ``pipeline_stages``, whose next decodes queue while a
    fourth (not asking for cohorts) holds the engine: the sessions of every batch the engine ran
    after the prefills, and each session's two tokens."""
    harness = WorkerHarness(RecordingEngine(max_sessions=4), WorkerConfig(batch_limits=None))
    prompts = {"a": [1, 2, 3], "b": [9, 8, 7, 6], "c": [5]}
    streams, tokens = {}, {}
    for name, prompt in [*prompts.items(), ("z", [4, 4])]:
        stream, _ = harness.open(
            make_route(pipeline_stages=0 if name == "z" else pipeline_stages), session_id=name
        )
        (token,) = result_tokens(harness.ask(stream, chunk_request(1, prompt, session_id=name)))
        streams[name], tokens[name] = stream, [token]
    since = len(harness.engine.batches)
    actions = harness.send(streams["z"], decode_request(2, 1, 2), run=False)
    assert [a for a in actions if isinstance(a, RunBatch)]  # z holds the engine
    for name, prompt in prompts.items():
        actions += harness.send(streams[name], decode_request(2, tokens[name][0], len(prompt)), run=False)
    out = harness.run(actions)
    for name in prompts:
        (token,) = result_tokens(responses(out, streams[name]))
        tokens[name].append(token)
    # The prefill's token and one decode's: exactly what the model gives each alone.
    assert tokens == {**{name: reference(prompt, 1) for name, prompt in prompts.items()}, "z": tokens["z"]}
    batches = [
        [step.request.session.session_id for step in batch] for batch in harness.engine.batches[since:]
    ]
    return batches, tokens


def test_sessions_of_a_three_stage_route_run_a_cohort_of_one_at_a_time_each_with_its_own_answer() -> None:
    batches, _ = decodes_of_three_sessions(pipeline_stages=3)
    assert batches == [["z"], ["a"], ["b"], ["c"]]


def test_without_cohorts_the_ready_sessions_share_one_batch() -> None:
    batches, _ = decodes_of_three_sessions(pipeline_stages=0)
    assert batches == [["z"], ["a", "b", "c"]]


def test_under_cohorts_the_free_engine_runs_what_is_ready_instead_of_waiting_for_sessions_due_back() -> None:
    """Four sessions of a two-stage route (cohorts of two), a and b out of step: without cohorts
    the free engine would wait for a, due back at once, to share b's batch (the convoy,
    test_worker_batching.py); under cohorts b runs at once and a follows in a cohort of its own."""
    harness = WorkerHarness(RecordingEngine(max_sessions=4), WorkerConfig(batch_limits=None))
    streams, positions, tokens = {}, {}, {}
    for name, prompt in {"a": [1, 2, 3], "b": [4, 5], "c": [6], "d": [7]}.items():
        stream, _ = harness.open(make_route(pipeline_stages=2), session_id=name)
        (token,) = result_tokens(harness.ask(stream, chunk_request(1, prompt, session_id=name)))
        streams[name], positions[name], tokens[name] = stream, len(prompt), token
    first = harness.send(streams["a"], decode_request(2, tokens["a"], positions["a"]), run=False)
    (running,) = [a for a in first if isinstance(a, RunBatch)]
    harness.now += 2_000_000
    queued = harness.send(streams["b"], decode_request(2, tokens["b"], positions["b"]), run=False)
    assert not [a for a in queued if isinstance(a, RunBatch)]
    harness.now += 8_000_000
    finished = harness.batch_finished(running.batch_id, running.execute(harness.engine), harness.now)
    (alone,) = [a for a in finished if isinstance(a, RunBatch)]
    assert [step.request.session.session_id for step in alone.steps] == ["b"]
