"""meshnode.dataplane.arrival_forecast: when an awaited session's next unit is due, by its own
rhythm and by its cohort (the sessions whose results left with it)."""

from __future__ import annotations

from meshnode.dataplane.arrival_forecast import ArrivalForecast

MS = 1_000_000


def learnt(gap_ms: float, session_id: str = "a") -> ArrivalForecast:
    """A forecast that has seen ``session_id`` come back ``gap_ms`` after its result left."""
    forecast = ArrivalForecast()
    forecast.answered(session_id, 0)
    forecast.arrived(session_id, round(gap_ms * MS))
    return forecast


def test_a_session_is_due_its_learnt_gap_after_its_result_left_with_half_a_gap_of_slack() -> None:
    forecast = learnt(10)
    forecast.answered("a", 100 * MS)
    # Predicted at 110 ms; worth waiting for until 115 ms.
    assert forecast.due_within((), 101 * MS, horizon_ns=20 * MS) == 115 * MS
    # The wait never reaches past the horizon the worker chose.
    assert forecast.due_within((), 101 * MS, horizon_ns=12 * MS) == 113 * MS


def test_nothing_to_wait_for_when_the_session_is_ready_far_off_late_or_the_horizon_is_zero() -> None:
    forecast = learnt(10)
    forecast.answered("a", 100 * MS)
    assert forecast.due_within({"a"}, 101 * MS, horizon_ns=20 * MS) is None  # already in
    assert forecast.due_within((), 101 * MS, horizon_ns=5 * MS) is None  # due after the horizon
    assert forecast.due_within((), 115 * MS, horizon_ns=20 * MS) is None  # past its slack: late
    assert forecast.due_within((), 101 * MS, horizon_ns=0) is None


def test_the_gap_is_smoothed_over_arrivals() -> None:
    forecast = learnt(10)
    forecast.answered("a", 100 * MS)
    forecast.arrived("a", 120 * MS)  # a 20 ms gap: the smoothed one moves halfway, to 15 ms
    forecast.answered("a", 200 * MS)
    assert forecast.due_within((), 201 * MS, horizon_ns=50 * MS) == round((215 + 7.5) * MS)


def test_a_session_never_measured_is_not_waited_for() -> None:
    forecast = ArrivalForecast()
    forecast.answered("a", 0)
    assert forecast.due_within((), 1, horizon_ns=50 * MS) is None


def test_once_one_of_a_cohort_is_back_the_others_are_due_at_once() -> None:
    forecast = ArrivalForecast()
    for session_id in ("a", "b", "c"):
        forecast.answered(session_id, 0)  # one batch's results, leaving together
    forecast.arrived("a", 30 * MS)
    # b and c have no rhythm yet, but a is back: they are due within the cohort's 2 ms.
    assert forecast.due_within({"a"}, 30 * MS, horizon_ns=10 * MS) == 32 * MS
    forecast.arrived("b", 31 * MS)
    assert forecast.due_within({"a", "b"}, 31 * MS, horizon_ns=10 * MS) == 32 * MS
    # c missed its cohort's slack: not waited for any more.
    assert forecast.due_within({"a", "b"}, 32 * MS, horizon_ns=10 * MS) is None


def test_a_cohort_is_its_batch_only_and_a_forgotten_session_is_not_awaited() -> None:
    forecast = ArrivalForecast()
    forecast.answered("a", 0)
    forecast.answered("b", 5 * MS)  # another batch
    forecast.arrived("a", 30 * MS)
    assert forecast.due_within({"a"}, 30 * MS, horizon_ns=10 * MS) is None
    forecast.answered("a", 40 * MS)
    forecast.answered("c", 40 * MS)
    forecast.forget("c")
    forecast.arrived("a", 60 * MS)
    assert forecast.due_within({"a"}, 60 * MS, horizon_ns=10 * MS) is None
    assert len(forecast) == 2
