"""The batch scheduler alone (meshnode.dataplane.batching): limits, the prefill bound, fairness.

Each test files sessions, forms batches the way the worker does (``next`` until None,
``accept`` for what runs, the session filed again with its next unit or removed) and
asserts the exact membership of each batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from meshnode.dataplane.batching import BatchLimits, BatchScheduler


@dataclass
class Queued:
    """A session's queued units as (decode, tokens), and its owner."""

    owner: str
    units: deque[tuple[bool, int]]


class Sessions:
    def __init__(self, limits: BatchLimits) -> None:
        self.scheduler = BatchScheduler(limits)
        self.queues: dict[str, Queued] = {}

    def queue(self, session_id: str, owner: str, *units: tuple[bool, int]) -> None:
        queued = self.queues.setdefault(session_id, Queued(owner, deque()))
        was_empty = not queued.units
        queued.units.extend(units)
        if was_empty:
            self._refile(session_id)

    def batch(self, *, refuse: frozenset[str] = frozenset()) -> list[str]:
        """One batch: the sessions whose head unit ran (those in ``refuse`` were answered instead)."""
        plan = self.scheduler.plan()
        ran = []
        while (session_id := plan.next()) is not None:
            self.queues[session_id].units.popleft()
            if session_id not in refuse:
                plan.accept(session_id)
                ran.append(session_id)
            self._refile(session_id)
        return ran

    def batches(self) -> list[list[str]]:
        out = []
        while batch := self.batch():
            out.append(batch)
        return out

    def _refile(self, session_id: str) -> None:
        queued = self.queues[session_id]
        if queued.units:
            decode, tokens = queued.units[0]
            self.scheduler.file(session_id, queued.owner, decode=decode, tokens=tokens)
        else:
            self.scheduler.remove(session_id)


DECODE = (True, 1)


def chunk(tokens: int) -> tuple[bool, int]:
    return (False, tokens)


def test_every_ready_decode_joins_one_batch_up_to_the_unit_limit() -> None:
    sessions = Sessions(BatchLimits(max_units=3, max_tokens=100))
    for name in "abcd":
        sessions.queue(name, "peer", DECODE, DECODE)
    assert sessions.batches() == [["a", "b", "c"], ["d", "a", "b"], ["c", "d"]]


def test_a_batch_takes_at_most_one_unit_per_session() -> None:
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=100))
    sessions.queue("a", "peer", DECODE, DECODE, DECODE)
    assert sessions.batches() == [["a"], ["a"], ["a"]]


def test_the_token_limit_leaves_out_what_does_not_fit_but_a_unit_alone_always_runs() -> None:
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=10))
    sessions.queue("big", "p", chunk(40))
    sessions.queue("a", "p", DECODE)
    # The 40-token chunk is over the limit alone: it runs alone, and the decode waits one batch.
    assert sessions.batches() == [["big"], ["a"]]


def test_one_prefill_chunk_per_batch_with_the_decodes_riding_along() -> None:
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=100))
    sessions.queue("p1", "x", chunk(8), chunk(8))
    sessions.queue("p2", "y", chunk(8))
    sessions.queue("d1", "x", DECODE, DECODE)
    sessions.queue("d2", "y", DECODE)
    assert sessions.batches() == [["p1", "d1", "d2"], ["p2", "d1"], ["p1"]]


def test_a_long_prompt_delays_a_decode_by_at_most_one_chunk() -> None:
    # A chunk fills a batch's tokens, so no decode fits beside it: the two kinds take turns.
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=16))
    sessions.queue("prompt", "x", *[chunk(16)] * 6)
    sessions.queue("d", "y", *[DECODE] * 3)
    assert sessions.batches() == [
        ["prompt"],
        ["d"],
        ["prompt"],
        ["d"],
        ["prompt"],
        ["d"],
        ["prompt"],
        ["prompt"],
        ["prompt"],
    ]


def test_decodes_first_takes_a_chunk_after_them_when_it_fits() -> None:
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=12))
    sessions.queue("prompt", "x", chunk(10), chunk(10))
    sessions.queue("d1", "y", DECODE, DECODE)
    sessions.queue("d2", "z", DECODE, DECODE)
    sessions.queue("d3", "w", DECODE, DECODE)
    # The first chunk leaves room for two decodes; d3, left out, goes first next time with
    # the others, and the second chunk no longer fits behind three decodes.
    assert sessions.batches() == [["prompt", "d1", "d2"], ["d3", "d1", "d2"], ["prompt", "d3"]]


def test_an_owner_with_many_sessions_gets_one_turn_per_round_like_an_owner_with_one() -> None:
    sessions = Sessions(BatchLimits(max_units=2, max_tokens=100))
    for i in range(1, 7):
        sessions.queue(f"a{i}", "A", *[DECODE] * 3)
    sessions.queue("b", "B", *[DECODE] * 3)
    first = [sessions.batch() for _ in range(3)]
    assert first == [["a1", "b"], ["a2", "b"], ["a3", "b"]]


def test_fairness_holds_within_an_owner_too() -> None:
    sessions = Sessions(BatchLimits(max_units=1, max_tokens=100))
    for name in ("x1", "x2", "x3"):
        sessions.queue(name, "X", DECODE, DECODE)
    assert sessions.batches() == [["x1"], ["x2"], ["x3"], ["x1"], ["x2"], ["x3"]]


def test_prompts_queued_for_the_one_chunk_take_turns_across_owners() -> None:
    sessions = Sessions(BatchLimits(max_units=4, max_tokens=100))
    sessions.queue("a1", "A", chunk(4), chunk(4))
    sessions.queue("a2", "A", chunk(4), chunk(4))
    sessions.queue("b", "B", chunk(4), chunk(4))
    # B's one prompt gets every other chunk; A's two share the rest.
    assert sessions.batches() == [["a1"], ["b"], ["a2"], ["b"], ["a1"], ["a2"]]


def test_a_refused_unit_takes_no_room_and_its_session_waits_for_the_next_batch() -> None:
    sessions = Sessions(BatchLimits(max_units=2, max_tokens=100))
    for name in "abc":
        sessions.queue(name, name, DECODE, DECODE)
    assert sessions.batch(refuse=frozenset({"a"})) == ["b", "c"]
    assert sessions.batch() == ["a", "b"]


def test_without_mixing_a_chunk_runs_alone_and_never_twice_in_a_row_while_decodes_wait() -> None:
    sessions = Sessions(BatchLimits(max_units=8, max_tokens=100, mix_prefill=False))
    sessions.queue("prompt", "x", *[chunk(8)] * 3)
    sessions.queue("d1", "y", DECODE, DECODE)
    sessions.queue("d2", "z", DECODE, DECODE)
    assert sessions.batches() == [["prompt"], ["d1", "d2"], ["prompt"], ["d1", "d2"], ["prompt"]]


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BatchLimits(max_units=0, max_tokens=1)
    with pytest.raises(ValueError):
        BatchLimits(max_units=1, max_tokens=0)
    with pytest.raises(ValueError):
        BatchLimits(max_units=1, max_tokens=1, max_prefill_chunks=0)
