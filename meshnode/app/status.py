"""A running node's status: asked through its data directory's status socket, and shown as text.

The node serves the socket (:class:`meshnode.node.status_server.StatusServer`): a
client sends the line ``status`` and reads one JSON object
(:meth:`meshnode.node.status_report.StatusReport.to_json`) until the node closes
the connection.
``meshnode status``, ``invite``, ``generate`` and ``doctor`` ask it this way.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from meshnode.membership.store import DataDir


def query_status(data_dir: Path, timeout: float = 3.0) -> dict[str, Any]:
    """Ask the node running on ``data_dir`` for its status; ``OSError`` when none answers."""
    path = DataDir(data_dir).control_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        client.connect(str(path))
        client.sendall(b"status\n")
        chunks = []
        while chunk := client.recv(65536):
            chunks.append(chunk)
    return dict(json.loads(b"".join(chunks)))


def format_status(status: dict[str, Any]) -> str:
    node = status["node"]
    lines = [
        f"node {node['short_id']}  mesh {node['mesh_id']}  {'member' if node['member'] else 'joining'}",
        f"  addresses: {', '.join(node['addresses'])}   serving: {_serving_text(node['serving'])}"
        f"{_sessions_text(node)}",
    ]
    if node.get("api_url"):
        lines.append(f"  API: {node['api_url']}/v1 (try: meshnode generate --prompt ...)")
    lines.append(f"peers ({len(status['peers'])}):")
    for peer in sorted(status["peers"], key=lambda p: p["short_id"]):
        reach = "direct" if peer["directly_reachable"] else "relay"
        link = peer["link"] or "no link"
        lines.append(
            f"  {peer['short_id']}  {', '.join(peer['addresses']) or '-'}  {reach}  {link}  "
            f"serving {_serving_text(peer['serving'])}{_sessions_text(peer)}  heard {peer['age_s']:.1f}s ago"
        )
    return "\n".join(lines)


def _sessions_text(entry: dict[str, Any]) -> str:
    """``  sessions 3/28``: the announced load against the announced capacity (nothing when serving
    nothing; an older node's report may lack them)."""
    capacity = (entry.get("capacity") or {}).get("max_concurrent_sessions")
    if not entry.get("serving") or not capacity:
        return ""
    active = (entry.get("load") or {}).get("active_sessions", 0)
    return f"  sessions {active}/{capacity}"


def _serving_text(serving: dict[str, Any] | None) -> str:
    if not serving:
        return "nothing"
    span = f"[{serving['start_layer']}:{serving['end_layer']}) of {serving['total_layers']}"
    return f"{serving['model']} {span} ({serving.get('numerics') or 'numerics unreported'})"


__all__ = ["format_status", "query_status"]
