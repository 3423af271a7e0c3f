"""The mesh as the console shows it, built from one node's status report.

:func:`mesh_view` takes the JSON of :meth:`meshnode.node.status_report.StatusReport.to_json`
(what ``meshnode status --json`` prints) and returns what ``/meshnode/mesh`` serves:
every node this node knows with what it serves, its announced load and how this
node reaches it (directly or through a relay); per model, which layers are covered
by whom; and the report's extra sections (a node's transfer progress, its resident
memory) unchanged. It is pure: the same report gives the same view, so it is tested
without a node.

Tokens per second are not computed here: the view carries counters and the
time they were read, and the page divides the difference between two of its own
polls. A rate kept on the server would be shared by every open page and changed
by each of them (as a scrape-to-scrape gauge is by a second scraper).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshnode.identity import short_id

# How this node reaches a peer, from the status report's link description ("quic HOST:PORT",
# "relay RELAY", None without a live link).
LINK_DIRECT = "direct"
LINK_RELAY = "relay"
LINK_NONE = "none"
LINK_SELF = "self"


@dataclass(frozen=True)
class Throughput:
    """Monotonic counters of this node, read at ``at_s`` (seconds on a monotonic clock)."""

    at_s: float
    # Tokens this node's head generated for API clients.
    generated_tokens: int = 0
    # Tokens this node's shard ran through its engine (prefill and decode).
    shard_tokens: int = 0
    # Generations running in this node's head.
    active_generations: int = 0


def link_kind(description: str | None) -> str:
    """``direct``, ``relay`` or ``none`` for a status report's ``link`` field."""
    if not description:
        return LINK_NONE
    return LINK_RELAY if description.startswith("relay") else LINK_DIRECT


def _serving(serving: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not serving:
        return None
    return {
        "model": serving["model"],
        "digest": serving.get("model_digest", ""),
        "start_layer": int(serving["start_layer"]),
        "end_layer": int(serving["end_layer"]),
        "total_layers": int(serving["total_layers"]),
        "numerics": serving.get("numerics", ""),
    }


def _load(entry: Mapping[str, Any]) -> dict[str, Any]:
    load = entry.get("load") or {}
    capacity = entry.get("capacity") or {}
    return {
        "active_sessions": int(load.get("active_sessions", 0)),
        "max_sessions": int(capacity.get("max_concurrent_sessions", 0)),
        "queued_chunks": int(load.get("queued_chunks", 0)),
        "kv_pressure": float(load.get("kv_pressure", 0.0)),
    }


def _self_node(node: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": node["id"],
        "short_id": node["short_id"],
        "self": True,
        "role": "this node",
        "addresses": list(node.get("addresses", [])),
        "directly_reachable": bool(node.get("directly_reachable", True)),
        "link": {"kind": LINK_SELF, "description": None},
        "serving": _serving(node.get("serving")),
        "load": _load(node),
        "heard_s": 0.0,
        "api_url": node.get("api_url"),
    }


def _peer_node(peer: Mapping[str, Any]) -> dict[str, Any]:
    role = str(peer.get("role", ""))
    return {
        "id": peer["id"],
        "short_id": peer["short_id"],
        "self": False,
        "role": role.removeprefix("NODE_ROLE_").lower() or "unknown",
        "addresses": list(peer.get("addresses", [])),
        "directly_reachable": bool(peer.get("directly_reachable", True)),
        # "path": how a direct link came about ("public", "lan", "punched"), or "relayed".
        "link": {
            "kind": link_kind(peer.get("link")),
            "description": peer.get("link"),
            "path": peer.get("path"),
        },
        "serving": _serving(peer.get("serving")),
        "load": _load(peer),
        "heard_s": float(peer.get("age_s", 0.0)),
        "admitted": bool(peer.get("admitted", False)),
        "version": peer.get("version", ""),
    }


def layer_coverage(total_layers: int, ranges: Sequence[tuple[int, int, str]]) -> list[dict[str, Any]]:
    """``[0, total_layers)`` cut where any range starts or ends; each segment with the nodes
    (``ranges``' third item) serving all of it. Segments no node serves have an empty list."""
    cuts = {0, total_layers}
    for start, end, _ in ranges:
        cuts.update(cut for cut in (start, end) if 0 <= cut <= total_layers)
    edges = sorted(cuts)
    segments = []
    for start, end in itertools.pairwise(edges):
        nodes = sorted(node for s, e, node in ranges if s <= start and end <= e)
        segments.append({"start_layer": start, "end_layer": end, "nodes": nodes})
    return segments


def _models(nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per model any node serves: its layer coverage and whether every layer has a server."""
    by_model: dict[tuple[str, str, int], list[tuple[int, int, str]]] = {}
    for node in nodes:
        serving = node["serving"]
        if serving is None:
            continue
        key = (serving["model"], serving["digest"], serving["total_layers"])
        by_model.setdefault(key, []).append((serving["start_layer"], serving["end_layer"], node["short_id"]))
    models = []
    for (name, digest, total), ranges in sorted(by_model.items()):
        segments = layer_coverage(total, ranges)
        covered = sum(s["end_layer"] - s["start_layer"] for s in segments if s["nodes"])
        models.append(
            {
                "name": name,
                "digest": digest,
                "total_layers": total,
                "covered_layers": covered,
                "complete": covered == total,
                # The fewest servers any layer has: how many nodes may fail before a layer has none.
                "min_replicas": min((len(s["nodes"]) for s in segments), default=0),
                "segments": segments,
            }
        )
    return models


def _relay(relay: Mapping[str, Any]) -> dict[str, Any]:
    """One of this node's relays as its status says, with the short id people read elsewhere."""
    return {**relay, "short_id": short_id(bytes.fromhex(relay["id"]))}


def mesh_view(status: Mapping[str, Any], throughput: Throughput) -> dict[str, Any]:
    """What the console shows of the mesh, from this node's status report ``status``."""
    node = status["node"]
    peers = sorted((_peer_node(peer) for peer in status.get("peers", [])), key=lambda n: n["short_id"])
    nodes = [_self_node(node), *peers]
    relayed = sum(1 for n in nodes if n["link"]["kind"] == LINK_RELAY)
    return {
        "node_id": node["id"],
        "short_id": node["short_id"],
        "mesh_id": node.get("mesh_id", ""),
        "member": bool(node.get("member", False)),
        "uptime_s": float(node.get("uptime_s", 0.0)),
        "relays": [_relay(relay) for relay in node.get("relays", [])],
        "nodes": nodes,
        "links": {
            "direct": sum(1 for n in nodes if n["link"]["kind"] == LINK_DIRECT),
            "relay": relayed,
            "none": sum(1 for n in nodes if n["link"]["kind"] == LINK_NONE),
        },
        "models": _models(nodes),
        "throughput": {
            "at_s": throughput.at_s,
            "generated_tokens": throughput.generated_tokens,
            "shard_tokens": throughput.shard_tokens,
            "active_generations": throughput.active_generations,
        },
        # Transfer progress ("placement"), resident memory ("memory"), ...: as the node reports them.
        "sections": dict(status.get("sections") or {}),
    }


__all__ = [
    "LINK_DIRECT",
    "LINK_NONE",
    "LINK_RELAY",
    "LINK_SELF",
    "Throughput",
    "layer_coverage",
    "link_kind",
    "mesh_view",
]
