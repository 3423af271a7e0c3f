"""The status socket: a local client sends the line ``status`` and reads the node's report as JSON.

Other one-line requests (``revoke ...``, ``grant-admin ...``: the membership
commands) go to ``control``, which answers a JSON object too.

It is the data directory's control socket (mode 0600 in a private directory, so
only the node's user can ask); :mod:`meshnode.statussocket.client` is its client. One
request per connection, answered with one JSON line, then the node closes it. A node
serves it (meshnode.node.runtime), and so do processes that are no node
(:mod:`meshnode.statussocket.standalone`: ``meshnode serve``, the relay).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from meshnode.identity import ensure_private_dir
from meshnode.membership.socket_path import reachable_socket_path

log = logging.getLogger(__name__)

# A request longer than this is refused; nothing more of it is kept (a revocation is ~200 bytes).
REQUEST_LIMIT = 4096
REQUEST_TIMEOUT_S = 2.0


class JsonReport(Protocol):
    """What the socket answers ``status`` with: a node's ``StatusReport``, or a standalone server's."""

    def to_json(self) -> dict[str, Any]: ...


class StatusServer:
    def __init__(
        self,
        path: Path,
        report: Callable[[], JsonReport],
        *,
        control: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self._report = report
        self._control = control
        self._server: asyncio.Server | None = None
        # The socket file this server made: another process may replace it at the path (a node
        # taking the directory from `meshnode serve`), and closing must not unlink that one.
        self._inode: int | None = None

    async def start(self) -> None:
        """Listen on ``path``; a socket that cannot be made is a warning, not a failed node."""
        ensure_private_dir(self.path.parent)
        self.path.unlink(missing_ok=True)  # the node holds the data-dir lock: a leftover socket is stale
        try:
            with reachable_socket_path(self.path) as reachable:
                self._server = await asyncio.start_unix_server(self._serve, path=reachable)
        except OSError as exc:
            log.warning(
                "no status socket at %s (%s); `meshnode status` will not reach this node", self.path, exc
            )
            return
        self.path.chmod(0o600)
        self._inode = self.path.stat().st_ino

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            if self._still_ours():
                self.path.unlink(missing_ok=True)

    def _still_ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                line = await reader.readline()
            request = line.strip() if len(line) <= REQUEST_LIMIT else b""
            answer: dict[str, Any]
            if request == b"status":
                answer = self._report().to_json()
            elif self._control is not None and request:
                answer = self._control(request.decode("ascii", "replace"))
            else:
                answer = {"error": "unknown request"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


__all__ = ["REQUEST_LIMIT", "JsonReport", "StatusServer"]
