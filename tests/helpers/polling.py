"""Waiting in a test for something to become true: ``eventually`` in a coroutine, ``wait_until`` in plain code.

Both call ``predicate`` until it returns something truthy and return that value; when
``timeout`` passes first they fail with an ``AssertionError`` naming what was awaited
(``what``, else the predicate's name). The timeout only keeps a broken test from hanging:
nothing here measures or asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _failure(predicate: Callable[[], object], timeout: float, what: str | None) -> AssertionError:
    return AssertionError(
        f"not true within {timeout:g} s: {what or getattr(predicate, '__name__', predicate)}"
    )


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    what: str | None = None,
    *,
    interval: float = 0.02,
) -> T:
    """Poll ``predicate`` (plain or async) every ``interval`` seconds until it is truthy."""
    try:
        async with asyncio.timeout(timeout) as scope:
            while True:
                value = predicate()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value
                await asyncio.sleep(interval)
    except TimeoutError:
        if not scope.expired():
            raise  # the predicate's own timeout, not ours
        raise _failure(predicate, timeout, what) from None


def wait_until(
    predicate: Callable[[], T], timeout: float = 10.0, what: str | None = None, *, interval: float = 0.1
) -> T:
    """Poll ``predicate`` every ``interval`` seconds, blocking, until it is truthy."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise _failure(predicate, timeout, what)
        time.sleep(interval)
    return value


__all__ = ["eventually", "wait_until"]
