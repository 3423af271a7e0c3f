"""Ending a helper task without losing the caller's own cancellation.

``task.cancel()`` followed by ``with suppress(CancelledError): await task`` eats two
cancellations, not one: the helper's, and the caller's own when the caller is
cancelled while it waits there. A caller cancelled at that moment then goes on as if
nothing happened: a placement task kept retrying after its node had stopped, and the
process never exited. :func:`cancel_and_wait` ends the helper and passes the caller's
cancellation on.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any], *, quiet: tuple[type[BaseException], ...] = ()) -> None:
    """Cancel ``task`` and wait until it has ended. Its own cancellation, and the exceptions in
    ``quiet``, end here; any other exception it ends with is raised, and so is a cancellation of
    the caller while it waits."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except quiet:
        pass


__all__ = ["cancel_and_wait"]
