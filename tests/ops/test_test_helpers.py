"""The tests' own polling helpers (tests/helpers/polling.py): what they return and how they fail."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from helpers.polling import eventually, wait_until


async def test_eventually_returns_the_first_truthy_value_of_a_plain_or_async_predicate() -> None:
    calls = itertools.count(1)
    assert await eventually(lambda: (n := next(calls)) >= 3 and n, interval=0) == 3

    answers = iter([None, "", "ready"])

    async def asked() -> str | None:
        await asyncio.sleep(0)
        return next(answers)

    assert await eventually(asked, interval=0) == "ready"


async def test_eventually_fails_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"not true within 0\.05 s: the moon to rise"):
        await eventually(lambda: False, 0.05, "the moon to rise")

    def never() -> bool:
        return False

    with pytest.raises(AssertionError, match=r"not true within 0\.05 s: never"):
        await eventually(never, 0.05)


async def test_a_timeout_of_the_predicate_itself_is_not_taken_for_its_own() -> None:
    async def times_out() -> bool:
        raise TimeoutError("the predicate's own")

    with pytest.raises(TimeoutError, match="the predicate's own"):
        await eventually(times_out, 10)


def test_wait_until_returns_the_truthy_value_or_fails_naming_what() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 2 and n, interval=0) == 2
    with pytest.raises(AssertionError, match=r"not true within 0\.05 s: the kettle to boil"):
        wait_until(lambda: 0, 0.05, "the kettle to boil", interval=0.01)
