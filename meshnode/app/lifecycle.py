"""A node process's life: start, join or reconnect, serve until a signal, drain, leave.

:func:`run_node` is what ``meshnode create``, ``join`` and ``start`` end in;
:func:`run_drain` is its drain step, which ``meshnode serve`` uses too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from meshnode.app.join_retry import DEFAULT_JOIN_TIMEOUT_S, JoinStopped, join_until
from meshnode.commandline.cli_error import CliError
from meshnode.node import JoinError

if TYPE_CHECKING:
    from meshnode.node import Node
from meshnode.transport.bind_errors import ListenError

log = logging.getLogger(__name__)


async def run_node(
    node: Node,
    *,
    on_ready: Callable[[Node], None] | None = None,
    on_started: Callable[[Node], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    drain_timeout: float = 30.0,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
) -> int:
    """Start, join or reconnect, serve until SIGINT/SIGTERM, then leave cleanly. Returns an exit code.

    With ``drain``, the first signal drains first: ``drain()`` stops new work and
    returns once in-flight work is done; it is given ``drain_timeout`` seconds, and a
    second signal cuts it short. PeerLeaving goes out after the drain either way.
    ``on_started`` runs once the node's socket is bound, before it joins (what listens beside
    it: the bulk lane). A joiner keeps trying bootstrap peers it cannot reach for ``join_timeout`` seconds (:mod:`.join_retry`).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        try:
            await node.start()
        except ListenError as exc:
            raise CliError(
                f"{exc}; choose another with --listen HOST:PORT (port 0 picks a free one)"
            ) from None
        if on_started is not None:
            await on_started(node)
        if node.state.is_member:
            await node.reconnect()
        else:
            try:
                await join_until(node, stop, join_timeout)
            except JoinStopped as exc:
                # Asked to stop (Ctrl-C, SIGTERM): a clean exit, like a stop once serving.
                log.info("%s; nothing was stored", exc)
                return 0
            except JoinError as exc:
                log.error("%s", exc)
                return 3
        if node.removal.is_set():
            return _removed(node)
        if on_ready is not None:
            on_ready(node)
        await _until_stopped_or_removed(stop, node)
        if node.removal.is_set():
            return _removed(node)
        if drain is not None:
            stop.clear()
            await run_drain(drain, stop, drain_timeout)
        log.info("stopping: telling peers we are leaving")
        return 0
    finally:
        await node.shutdown()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


REMOVED_EXIT_CODE = 4


def _removed(node: Node) -> int:
    """A removed node (or one whose certificate expired) leaves without draining: nobody will
    serve its work any more."""
    log.error("exiting: %s", node.removal_reason)
    return REMOVED_EXIT_CODE


async def _until_stopped_or_removed(stop: asyncio.Event, node: Node) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(node.removal.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def run_drain(drain: Callable[[], Awaitable[None]], stop: asyncio.Event, timeout: float) -> None:
    """Run ``drain()`` for at most ``timeout`` seconds or until ``stop`` is set again."""
    log.info(
        "draining: refusing new work, finishing what is in flight (up to %.0f s; signal again to stop now)",
        timeout,
    )
    draining = asyncio.ensure_future(drain())
    interrupted = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait(
        {draining, interrupted}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
    )
    for task in (draining, interrupted):
        task.cancel()
    await asyncio.gather(draining, interrupted, return_exceptions=True)
    if draining in done and draining.exception() is None:
        log.info("drained: no work in flight")
    elif interrupted in done:
        log.warning("second signal: stopping without waiting for in-flight work")
    else:
        log.warning("drain did not finish within %.0f s: stopping with work in flight", timeout)


__all__ = ["REMOVED_EXIT_CODE", "run_drain", "run_node"]
