"""The status socket's client: one request line to the process answering on a data directory,
one JSON object back (:mod:`meshnode.statussocket.server` is the other end).

Asked by ``meshnode status`` and the commands that talk to a running node
(meshnode.app.status shows the answer as text), and by a process that is no node before it
answers there itself (:mod:`meshnode.statussocket.standalone`).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from meshnode.membership.socket_path import reachable_socket_path
from meshnode.membership.store import DataDir


def query_status(data_dir: Path, timeout: float = 3.0) -> dict[str, Any]:
    """Ask the node running on ``data_dir`` for its status; ``OSError`` when none answers."""
    return ask_node(data_dir, "status", timeout)


def ask_node(data_dir: Path, request: str, timeout: float = 3.0) -> dict[str, Any]:
    """Send one request line to the node running on ``data_dir``; its JSON answer, ``OSError`` when
    none answers."""
    path = DataDir(data_dir).control_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        with reachable_socket_path(path) as reachable:
            client.connect(reachable)
        client.sendall(request.encode("ascii") + b"\n")
        chunks = []
        while chunk := client.recv(65536):
            chunks.append(chunk)
    return dict(json.loads(b"".join(chunks)))


__all__ = ["ask_node", "query_status"]
