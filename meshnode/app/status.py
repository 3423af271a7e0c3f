"""A running node's status: asked through its data directory's status socket, and shown as text.

The node serves the socket (:class:`meshnode.statussocket.server.StatusServer`): a
client sends the line ``status`` and reads one JSON object
(:meth:`meshnode.node.status_report.StatusReport.to_json`) until the node closes
the connection (:mod:`meshnode.statussocket.client`).
``meshnode status``, ``invite``, ``generate`` and ``doctor`` ask it this way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshnode.identity import short_id
from meshnode.logs import mib
from meshnode.statussocket.client import query_status


class NotANodeError(OSError):
    """The data directory's socket answers for a ``meshnode serve`` process, not a mesh node."""


def query_node_status(data_dir: Path, timeout: float = 3.0) -> dict[str, Any]:
    """:func:`query_status` for commands that need a mesh node: ``OSError`` when none answers, and
    :class:`NotANodeError` (an ``OSError``) when a standalone server does."""
    status = query_status(data_dir, timeout)
    if "node" not in status:
        raise NotANodeError(f"a standalone server (meshnode serve), not a mesh node, answers on {data_dir}")
    return status


def format_status(status: dict[str, Any]) -> str:
    if "standalone" in status:
        return _standalone_text(status)
    if "relay" in status:
        return _relay_process_text(status["relay"])
    node = status["node"]
    lines = [
        f"node {node['short_id']}  mesh {node['mesh_id']}  {'member' if node['member'] else 'joining'}",
        f"  addresses: {', '.join(node['addresses'])}   serving: {_serving_text(node['serving'])}"
        f"{_sessions_text(node)}",
    ]
    if node.get("api_url"):
        lines.append(_api_line(node["api_url"]))
    lines += [_relay_line(relay) for relay in node.get("relays") or []]
    lines += _nat_lines(node, (status.get("sections") or {}).get("traversal"))
    startup = (status.get("sections") or {}).get("startup")
    if startup:
        lines.append(f"  starting: {startup['state']}")
    lines += _memory_lines(status)
    lines += _prefix_cache_lines(status)
    lines += _slow_stage_lines((status.get("sections") or {}).get("slow_stages"))
    lines += _route_lines((status.get("sections") or {}).get("routes"))
    lines += _audit_lines(status)
    placement = (status.get("sections") or {}).get("placement")
    if placement:
        lines.append(_placement_text(placement))
        lines += _slow_yield_lines(placement.get("slow_yield"))
    files = (status.get("sections") or {}).get("files") or {}
    lines += [f"  preparing: {_progress_text(file_pass)}" for file_pass in files.get("passes", [])]
    lines.append(f"peers ({len(status['peers'])}):")
    for peer in sorted(status["peers"], key=lambda p: p["short_id"]):
        reach = "direct" if peer["directly_reachable"] else "relay"
        link = _link_text(peer)
        lines.append(
            f"  {peer['short_id']}  {', '.join(peer['addresses']) or '-'}  {reach}  {link}  "
            f"serving {_serving_text(peer['serving'])}{_sessions_text(peer)}  heard {peer['age_s']:.1f}s ago"
        )
    lines += _membership_lines(status.get("membership") or {})
    lines += _evidence_lines(status.get("evidence") or {})
    return "\n".join(lines)


def _nat_lines(node: dict[str, Any], traversal: dict[str, Any] | None) -> list[str]:
    """Where relays see this node, what that says of its NAT, and how its punches went."""
    observed = node.get("observed_addresses") or []
    if not observed and not traversal:
        return []
    line = f"  seen by relays at {', '.join(observed) or '-'} (NAT mapping: {node.get('nat_mapping', 'unknown')})"
    line += f"; hole punching {node.get('hole_punching', 'off')}"
    if traversal:
        attempts = traversal.get("punch_attempts") or {}
        if attempts:
            line += ": " + ", ".join(f"{what} {n}" for what, n in sorted(attempts.items()))
        if traversal.get("direct_paths_lost"):
            line += f"; direct paths lost {traversal['direct_paths_lost']}"
    return [line]


def _link_text(peer: dict[str, Any]) -> str:
    """``quic 198.18.0.5:7447 (punched, 12 s)``: the live link, how it goes, since when."""
    link = peer.get("link")
    if not link:
        return "no link"
    path, since = peer.get("path"), peer.get("path_since_s")
    if path is None:
        return link
    return f"{link} ({path}{f', {since:.0f} s' if since is not None else ''})"


def _standalone_text(status: dict[str, Any]) -> str:
    """A `meshnode serve` process (meshnode.app.standalone_status): no mesh, no peers."""
    server = status["standalone"]
    lines = [
        f"standalone server (meshnode serve: no mesh), up {server['uptime_s']:.0f} s",
        f"  serving: {_serving_text(server['serving'])}{_sessions_text(server)}",
        _api_line(server["api_url"]),
        *_memory_lines(status),
        *_prefix_cache_lines(status),
    ]
    return "\n".join(lines)


def _api_line(url: str) -> str:
    return f"  API: {url}/v1 (try: meshnode generate --prompt ...)"


def _memory_lines(status: dict[str, Any]) -> list[str]:
    """The memory line of a process that reports its shard's memory (none where it does not)."""
    memory = (status.get("sections") or {}).get("memory")
    return [_memory_text(memory)] if memory else []


def _prefix_cache_lines(status: dict[str, Any]) -> list[str]:
    """``  prefix cache: 3 of 8 kept; 12 hits, 4 misses, 5120 tokens reused``: what the process's
    shard keeps of released prompts (meshnode.app.prefix_cache_status); none while it serves
    nothing, or from an older node."""
    section = (status.get("sections") or {}).get("prefix_cache")
    if not section:
        return []
    if not section.get("limit"):
        return ["  prefix cache: off"]
    return [
        f"  prefix cache: {section.get('entries', 0)} of {section['limit']} kept; "
        f"{section.get('hits', 0)} hits, {section.get('misses', 0)} misses, "
        f"{section.get('tokens_reused', 0)} tokens reused"
    ]


def _slow_stage_lines(section: dict[str, Any] | None) -> list[str]:
    """This node's verdict, and the other stages found slow (meshnode.app.slow_stage_status):
    ``  this node's stage: 3.1x the other stages' time for its layers, slow for 120 s``."""
    if not section:
        return []
    lines = []
    own = section.get("this_node")
    if own is not None:
        lines.append(f"  this node's stage: {_verdict_text(own, section)}")
    lines += [
        f"  slow stage: node {verdict['node']}, {_verdict_text(verdict, section)}"
        for verdict in section.get("slow", [])
        if own is None or verdict["node"] != own["node"]
    ]
    return lines


def _verdict_text(verdict: dict[str, Any], section: dict[str, Any]) -> str:
    text = f"{verdict['ratio']:.1f}x the other stages' time for its layers"
    pending, lasting = verdict.get("pending_s"), section.get("lasting_s", 0)
    if verdict["slow"]:
        text += f", slow for {verdict['since_s']:.0f} s: every route through it runs at its pace"
        if pending is not None:
            text += f" (back under {section['clear_ratio']:g}x for {pending:.0f} of {lasting:.0f} s)"
    elif pending is not None:
        text += f" (over {section['slow_ratio']:g}x for {pending:.0f} of {lasting:.0f} s before it is called slow)"
    return text


def _route_lines(section: dict[str, Any] | None) -> list[str]:
    """``  route for gemma: 66.0 ms/token expected (15.2 tokens/s): a1b2c3 [0,6) 12.0 ms, ...``:
    each model's route as a request would take it now (meshnode.head.route_time)."""
    if not section:
        return []
    lines = []
    for route in section.get("routes", []):
        step = route.get("decode_ms_per_token")
        expected = (
            f"{step:.1f} ms/token expected ({route['tokens_per_s']:.1f} tokens/s)"
            if step is not None
            else "time unknown (a hop announces no speed)"
        )
        hops = ", ".join(_hop_text(hop) for hop in route.get("hops", []))
        lines.append(f"  route for {route['model']}: {expected}: {hops}")
    return lines


def _hop_text(hop: dict[str, Any]) -> str:
    start, end = hop["layers"]
    decode = hop.get("decode_ms")
    text = f"{hop['node']} [{start},{end}) " + (f"{decode:.1f} ms" if decode is not None else "unannounced")
    return text + " SLOW" if hop.get("slow") else text


def _audit_lines(status: dict[str, Any]) -> list[str]:
    """``  audits: 2% of generations; 14 audited, ...`` and a line per node convicted
    (meshnode.app.audit_status); none on a node without a head, or from an older node."""
    section = (status.get("sections") or {}).get("audits")
    if not section:
        return []
    rate = section.get("rate", 0)
    if not rate:
        return ["  audits: off"]
    line = (
        f"  audits: {rate:.0%} of generations; {section.get('audited', 0)} audited, "
        f"{section.get('without_replica', 0)} without a replica, {section.get('disputes', 0)} disputes"
    )
    lines = [line]
    lines += [f"  CONVICTED {each['node']}: {each['verdict']}" for each in section.get("convicted") or []]
    return lines


def _relay_process_text(relay: dict[str, Any]) -> str:
    """A `meshnode relay` process (relay.status)."""
    members = relay["members"]
    lines = [
        f"relay {relay['short_id']}  listening on {relay['address']}  up {relay['uptime_s']:.0f} s",
        f"  meshes: {', '.join(relay['meshes'])}",
        f"  connections {relay['connections']} ({relay['unregistered']} not registered); "
        f"{relay['registrations']} registrations since start",
        f"  forwarded {relay['frames_forwarded']} frames, {mib(relay['bytes_forwarded'])}; queued "
        f"{mib(relay['queued_bytes'])} of {mib(relay['queued_bytes_limit'])}",
    ]
    for kind in ("frames", "connections"):
        refused = relay[f"{kind}_refused"]
        if refused:
            counts = ", ".join(
                f"{reason.removeprefix('RELAY_ERROR_')} {n}" for reason, n in sorted(refused.items())
            )
            lines.append(f"  {kind} refused: {counts}")
    if relay.get("metrics_url"):
        lines.append(f"  metrics: {relay['metrics_url']}")
    lines.append(f"members registered ({len(members)}):")
    lines += [
        f"  {member['short_id']}  mesh {member['mesh_id']}  from {member.get('address', '?')}"
        + (f"  queued {mib(member['queued_bytes'])}" if member["queued_bytes"] else "")
        for member in members
    ]
    return "\n".join(lines)


def _relay_line(relay: dict[str, Any]) -> str:
    named = f"{short_id(bytes.fromhex(relay['id']))}@{relay['address']}"
    if relay["registered"]:
        return f"  relay {named}: registered"
    return f"  relay {named}: not registered ({relay.get('problem') or 'connecting'})"


def _membership_lines(membership: dict[str, Any]) -> list[str]:
    """Who is admin, when each member's certificate expires, and the removals this node knows."""
    if not membership:
        return []
    lines = [f"  this node is {'an admin' if membership.get('admin') else 'a plain member'}"]
    members = membership.get("members", [])
    lines.append(f"members ({len(members)} known certificates):")
    for member in members:
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(member["certificate_expires_unix"]))
        role = "admin" if member["admin"] else "member"
        this = "  (this node)" if member.get("self") else ""
        lines.append(f"  {role:6} {member['short_id']}  certificate expires {expires}{this}")
    removals = membership.get("removals", [])
    lines.append(f"removals ({len(removals)}):")
    for removal in removals:
        reason = f": {removal['reason']}" if removal["reason"] else ""
        lines.append(f"  removed {removal['kind']} {removal['short_id']}  by admin {removal['by']}{reason}")
    return lines


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    """The audit evidence this node holds (each verified; meshnode.audit.evidence_book), and the
    reports it refused by code; nothing when it holds and refused none (or from an older node)."""
    held, refused = evidence.get("held") or [], evidence.get("refused") or {}
    policy = evidence.get("policy")
    if not held and not refused and not policy:
        return []
    lines = [f"audit evidence ({len(held)}):"]
    if policy:
        cleared = ", ".join(short_id(bytes.fromhex(n)) for n in policy["cleared"]) or "none"
        quarantine = "quarantine on evidence" if policy["quarantine_on_evidence"] else "no quarantine"
        handoffs = "; handoffs required" if policy.get("require_handoffs") else ""
        lines.append(f"  mesh policy by admin {policy['by']}: {quarantine}; cleared: {cleared}{handoffs}")
    for each in held:
        start, end = each["layers"]
        quarantined = "  QUARANTINED" if each.get("quarantined") else ""
        lines.append(
            f"  CONVICTED {each['accused']}  layers [{start},{end})  reported by {each['reporter']}  "
            f"evidence {each['digest'][:16]}{quarantined}: {each['verdict']}"
        )
    if refused:
        lines.append("  refused: " + ", ".join(f"{code} {n}" for code, n in sorted(refused.items())))
    return lines


def _sessions_text(entry: dict[str, Any]) -> str:
    """``  sessions 3/28``: the announced load against the announced capacity (nothing when serving
    nothing; an older node's report may lack them)."""
    capacity = (entry.get("capacity") or {}).get("max_concurrent_sessions")
    if not entry.get("serving") or not capacity:
        return ""
    active = (entry.get("load") or {}).get("active_sessions", 0)
    return f"  sessions {active}/{capacity}"


# The budget's parts as the memory line names them (an unknown one by its key).
_BUDGET_PARTS = {
    "weights_bytes": "weights",
    "kv_bytes": "KV",
    "compute_bytes": "compute",
    "output_bytes": "output",
    "vocabulary_bytes": "vocabulary",
    "context_table_bytes": "context tables",
}


def _memory_text(memory: dict[str, Any]) -> str:
    """``  memory: 96 MiB resident (46 file-backed); the shard 41 MiB against its budget 44 MiB
    (weights 25, KV 14, compute 4.9, output 0, vocabulary 0, context tables 0.2); not the shard's:
    tokenizer 40 MiB``
    (engines.resident_memory.ShardMemory.to_json)."""

    def in_mib(value: int) -> str:  # a number only: the line says MiB once per group
        return f"{value / (1 << 20):.2g}" if value < 10 << 20 else f"{value / (1 << 20):.0f}"

    budget = memory["budget"]
    parts = ", ".join(f"{_BUDGET_PARTS.get(name, name)} {in_mib(value)}" for name, value in budget.items())
    # An older node's report has no "outside_bytes".
    outside = ", ".join(
        f"{name} {in_mib(value)} MiB" for name, value in (memory.get("outside_bytes") or {}).items() if value
    )
    outside = f"; not the shard's: {outside}" if outside else ""
    return (
        f"  memory: {in_mib(memory['rss_bytes'])} MiB resident ({in_mib(memory['rss_file_bytes'])} file-backed); "
        f"the shard {in_mib(memory['shard_bytes'])} MiB against its budget {in_mib(memory['budget_bytes'])} MiB ({parts})"
        f"{outside}"
    )


def _placement_text(placement: dict[str, Any]) -> str:
    """``  placement: fetching layers [6, 18) of gemma: 120.0/216.9 MiB 55.3% 8.1 MiB/s ETA 0:12``
    (meshnode.autoplace.auto_shard.AutoShard.status)."""
    text = f"  placement: {placement['state']}"
    if placement.get("layers"):
        start, end = placement["layers"]
        text += f" layers [{start}, {end})"
    if placement.get("model"):
        text += f" of {placement['model']['name']}"
    transfer = placement.get("transfer")
    if transfer and not transfer.get("finished"):
        text += f": {_progress_text(transfer)}"
    return text


def _slow_yield_lines(section: dict[str, Any] | None) -> list[str]:
    """The layers this node gives up, or gave up, to faster replicas for being slow
    (meshnode.autoplace.auto_shard.AutoShard.status): ``  giving up layers in 20 of 60 s: stage
    3.00 ms/layer vs median 1.00; layers [3, 5) served faster by node ab12cd; now serving [5, 6)``."""
    if not section:
        return []
    lines = []
    pending = section.get("pending")
    if pending:
        runs = ", ".join(f"[{start}, {end})" for start, end in pending["given_up"])
        lines.append(
            f"  giving up layers {runs} to faster node {', '.join(pending['faster_nodes'])} "
            f"in {max(0.0, pending['settle_s'] - pending['pending_s']):.0f} s "
            f"(stage {pending['stage_ms_per_layer']:.2f} ms/layer vs median {pending['median_ms_per_layer']:.2f})"
        )
    last = section.get("last")
    if last:
        lines.append(f"  gave up layers for being slow: {last['reason']}")
    return lines


def _progress_text(progress: dict[str, Any]) -> str:
    """``hashing gemma.gguf: 120.0/253.0 MiB 47.4% 85.2 MiB/s ETA 2 s`` (the label when there is one)."""
    label = f"{progress['label']}: " if progress.get("label") else ""
    return (
        f"{label}{progress['done_bytes'] / 2**20:.1f}/{progress['total_bytes'] / 2**20:.1f} MiB "
        f"{progress['fraction'] * 100:.1f}% {progress['rate_bytes_per_s'] / 2**20:.1f} MiB/s{_eta_text(progress)}"
    )


def _eta_text(progress: dict[str, Any]) -> str:
    eta = progress.get("eta_s")
    if eta is not None:
        return f" ETA {eta:.0f} s"
    # A transfer too young for an honest ETA says so (artifacts.progress.ETA_AFTER_NS).
    return " ETA estimating" if progress.get("estimating") else ""


def _serving_text(serving: dict[str, Any] | None) -> str:
    if not serving:
        return "nothing"
    span = f"[{serving['start_layer']}:{serving['end_layer']}) of {serving['total_layers']}"
    state = serving.get("state", "serving")
    text = f"{serving['model']} {span} ({serving.get('numerics') or 'numerics unreported'})"
    text += _speed_text(serving)
    return text if state == "serving" else f"{text}, {state}"


def _speed_text(serving: dict[str, Any]) -> str:
    """``, decode 25.0 ms/token, prefill 1.2 ms/token (measured, 40 batches)``; empty when unsaid."""
    decode = serving.get("decode_ms_per_token")
    if decode is None:
        return ""
    prefill = serving.get("prefill_ms_per_token")
    prefill_text = f", prefill {prefill:.1f} ms/token" if prefill is not None else ""
    source = serving.get("speed_source") or "calibrated"
    samples = f", {serving.get('speed_samples', 0)} batches" if source == "measured" else ""
    return f", decode {decode:.1f} ms/token{prefill_text} ({source}{samples})"


__all__ = ["NotANodeError", "format_status", "query_node_status"]
