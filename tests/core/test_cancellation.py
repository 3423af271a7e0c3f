"""cancel_and_wait: the helper's cancellation ends there, the caller's does not."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from meshnode.cancellation import cancel_and_wait


async def slow_to_end() -> None:
    """A helper whose cleanup takes a moment, as a progress display or a pump's writer may."""
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep(0.05)


async def test_the_helpers_cancellation_ends_there():
    helper = asyncio.ensure_future(slow_to_end())
    await asyncio.sleep(0)
    await cancel_and_wait(helper)
    assert helper.cancelled()


async def test_a_caller_cancelled_while_it_waits_is_cancelled_and_not_carried_on():
    carried_on = asyncio.Event()

    async def caller(wait) -> None:
        helper = asyncio.ensure_future(slow_to_end())
        await asyncio.sleep(0)
        await wait(helper)
        carried_on.set()  # what a retry loop would do next
        await asyncio.sleep(3600)

    async def suppressing(helper) -> None:
        helper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await helper

    for wait, carries_on in ((suppressing, True), (cancel_and_wait, False)):
        carried_on.clear()
        task = asyncio.ensure_future(caller(wait))
        await asyncio.sleep(0.01)  # the caller waits for its helper's cleanup now
        task.cancel()
        await asyncio.sleep(0.1)
        # The old idiom loses the caller's cancellation: it carries on past the wait.
        assert carried_on.is_set() is carries_on, wait.__name__
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_other_exceptions_are_raised_unless_quiet():
    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise ConnectionError("broke while stopping")

    helper = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    with pytest.raises(ConnectionError):
        await cancel_and_wait(helper)
    helper = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(helper, quiet=(ConnectionError,))
