"""The data directory's status socket for processes that are not mesh nodes (``serve``, ``relay``).

A node owns its directory's socket (it holds the directory's lock). Another kind
of process answers ``meshnode status`` there only where nobody answers yet: it
leaves the socket to a node running on the same directory, and a node started
there later takes the socket over (the process does not unlink it on closing:
meshnode.statussocket.server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from meshnode.membership.store import DataDir
from meshnode.statussocket.client import query_status
from meshnode.statussocket.server import JsonReport, StatusServer

log = logging.getLogger(__name__)


async def answer_status(data_dir: Path, report: Callable[[], JsonReport], what: str) -> StatusServer | None:
    """Answer ``meshnode status`` on ``data_dir``'s socket with ``report()`` (close the server when
    done); ``None`` where another process already answers there. ``what``: this process, for the log."""
    try:
        await asyncio.to_thread(query_status, data_dir, 1.0)
    except OSError:
        pass  # nobody answers: the socket, if any, is a leftover
    else:
        log.info(
            "`meshnode status` on %s answers for the process already running there, not this %s "
            "(give it a --data-dir of its own to ask it)",
            data_dir,
            what,
        )
        return None
    server = StatusServer(DataDir(data_dir).control_socket, report)
    await server.start()
    return server


__all__ = ["answer_status"]
