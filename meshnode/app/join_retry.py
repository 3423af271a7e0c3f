"""``--join-timeout``: a joiner keeps trying bootstrap peers it cannot reach yet.

The inviting node may be restarting, or still loading its model, when a person runs
``meshnode join`` on another machine; one try of a few seconds and an exit would make them
start again by hand. A refusal is different: it is an answer (an expired or withdrawn
invite, another mesh), and another try would only repeat it, so it ends the join at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from meshnode.commandline.argument_types import non_negative
from meshnode.node import JoinError

if TYPE_CHECKING:
    from meshnode.node import Node

log = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 120.0
FIRST_RETRY_S = 1.0
LONGEST_RETRY_S = 10.0
UNREACHABLE_HINT = (
    "is the inviting node running, and reachable at the invite's address from here? A node "
    "behind NAT is reached through a relay (--relay on both)"
)


class JoinStopped(JoinError):
    """A signal stopped the join while it waited to try again: nothing went wrong."""


def next_retry_delay(previous: float | None) -> float:
    """Seconds before the next try: doubling from :data:`FIRST_RETRY_S` up to :data:`LONGEST_RETRY_S`."""
    return FIRST_RETRY_S if previous is None else min(2 * previous, LONGEST_RETRY_S)


def add_join_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--join-timeout",
        type=non_negative,
        default=DEFAULT_JOIN_TIMEOUT_S,
        metavar="SECONDS",
        help="keep trying bootstrap peers that cannot be reached for this long before giving up "
        f"(default {DEFAULT_JOIN_TIMEOUT_S:.0f}; 0: one try); a refusal ends the join at once",
    )


async def join_until(node: Node, stop: asyncio.Event, timeout_s: float) -> None:
    """``node.join()``, tried again while no bootstrap peer answers, for up to ``timeout_s``
    seconds or until ``stop`` is set. Raises :class:`JoinError` with the reason."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay: float | None = None
    while True:
        try:
            await node.join()
            return
        except JoinError as failure:
            if failure.refused:
                raise
            delay = next_retry_delay(delay)
            if loop.time() + delay > deadline:
                raise JoinError(
                    f"{failure} (gave up after {timeout_s:.0f} s); {UNREACHABLE_HINT}", refused=False
                ) from None
            log.warning("%s; trying again in %.0f s", failure, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            continue
        raise JoinStopped("stopped before joining the mesh", refused=False)


__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "JoinStopped", "add_join_options", "join_until", "next_retry_delay"]
