"""``meshnode status`` while a node prepares its model files: hashing the GGUF, writing its slice.

On a first start both take minutes for a large model, and they happen before the node
starts (its shard loads first, so it never announces a range it cannot serve), which is
also before the node opens its status socket. :func:`status_while_preparing` answers on
that socket meanwhile, with the node's report so far and the passes running
(:func:`engines.file_progress.passes_in_progress`); the node's own socket replaces it
when the node starts. The ``files`` section stays registered, so a node that places
itself and slices after joining shows the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from engines.file_progress import passes_in_progress
from meshnode.node import Node
from meshnode.node.status_report import StatusReport
from meshnode.statussocket.server import StatusServer

FILES_SECTION = "files"
# While the socket answers from here: what the node is doing before it starts.
STARTUP_SECTION = "startup"
LOADING_THE_SHARD = "loading its shard (hashing, slicing, probing and loading llama.cpp); not started yet"


def file_passes() -> dict[str, Any]:
    return {"passes": passes_in_progress()}


def show_file_passes(node: Node) -> None:
    node.add_status_section(FILES_SECTION, file_passes)


def status_before_start(node: Node) -> StatusReport:
    """The node's report with nothing served: its shard may be loaded, but it does not listen yet.

    Scripts wait for ``serving`` before they send work or read the node's addresses, so
    claiming the range before the node starts would send them to a node that cannot answer.
    """
    report = node.status()
    return dataclasses.replace(report, node=dataclasses.replace(report.node, serving=None))


@contextlib.asynccontextmanager
async def status_while_preparing(node: Node) -> AsyncIterator[None]:
    """The status socket, answered from here until the block ends (the node is not started yet)."""
    show_file_passes(node)
    node.add_status_section(STARTUP_SECTION, lambda: {"state": LOADING_THE_SHARD})
    server = StatusServer(node.data_dir.control_socket, lambda: status_before_start(node))
    await server.start()
    try:
        yield
    finally:
        server.close()
        node.remove_status_section(STARTUP_SECTION)


__all__ = [
    "FILES_SECTION",
    "LOADING_THE_SHARD",
    "STARTUP_SECTION",
    "file_passes",
    "show_file_passes",
    "status_before_start",
    "status_while_preparing",
]
