"""Prometheus text exposition (format 0.0.4) for ``GET /metrics``.

Values are read from the live objects at scrape time — the node, its shard
server and engine, the head, the relay links — rather than mirrored into a
registry on every event, so the hot path does no metrics work beyond the few
counters those objects keep anyway.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engines.resident_memory import ShardMemory, shard_memory

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass
class Family:
    """One metric family: a name, a type, help text and its labelled samples."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    # Per sample, what follows the family's name: "" but in a histogram ("_bucket", "_sum", "_count").
    suffixes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"bad metric {self.name!r} ({self.kind})")

    def add(self, value: float, labels: Mapping[str, str] | None = None, *, suffix: str = "") -> Family:
        labels = dict(labels or {})
        for key in labels:
            if not _LABEL.match(key):
                raise ValueError(f"bad label name {key!r}")
        self.samples.append((labels, float(value)))
        self.suffixes.append(suffix)
        return self


def counter(name: str, help: str, value: float | None = None) -> Family:
    family = Family(name, "counter", help)
    return family if value is None else family.add(value)


def gauge(name: str, help: str, value: float | None = None) -> Family:
    family = Family(name, "gauge", help)
    return family if value is None else family.add(value)


def histogram(name: str, help: str, buckets: Iterable[tuple[float, int]], total: float) -> Family:
    """``buckets``: (upper bound, observations at or below it), cumulative, ending with +Inf."""
    family = Family(name, "histogram", help)
    count = 0
    for bound, count in buckets:
        family.add(count, {"le": _format_value(float(bound))}, suffix="_bucket")
    return family.add(total, suffix="_sum").add(count, suffix="_count")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    seen: set[str] = set()
    for family in families:
        if family.name in seen:
            raise ValueError(f"metric {family.name} rendered twice")
        seen.add(family.name)
        lines.append(f"# HELP {family.name} {family.help.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for (labels, value), series in zip(family.samples, family.suffixes, strict=True):
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
            suffix = f"{{{label_text}}}" if label_text else ""
            lines.append(f"{family.name}{series}{suffix} {_format_value(value)}")
    return "\n".join(lines) + "\n"


# -- what a node exposes ----------------------------------------------------------------

_SERVING_STATES = {1: "serving", 2: "draining", 3: "not_serving"}


@dataclass
class MetricSources:
    """The live objects a node's ``/metrics`` reads; any may be absent."""

    node: Any = None  # meshnode.node.Node
    server: Any = None  # meshnode.dataplane.server.ShardServer
    driver: Any = None  # meshnode.head.driver.GenerationDriver
    _last_tokens: tuple[float, int] | None = None

    def tokens_per_second(self, now: float, tokens: int) -> float:
        """Generated tokens per second since the previous scrape (0 on the first)."""
        previous, self._last_tokens = self._last_tokens, (now, tokens)
        if previous is None or now <= previous[0]:
            return 0.0
        return max(0, tokens - previous[1]) / (now - previous[0])


async def collect(sources: MetricSources, *, now: float) -> list[Family]:
    from meshnode import __version__
    from meshnode.wire.pb import shard

    families = [gauge("meshnode_up", "1 while the node answers", 1)]
    info = gauge("meshnode_info", "Build and identity labels").add(1, {"version": __version__})
    families.append(info)
    families += _frame_buffer_families()
    node = sources.node
    if node is not None:
        info.samples[0][0].update(node_id=node.node_id.hex()[:16], mesh_id=node.mesh_id or "")
        peers = node.peers()
        families.append(gauge("meshnode_peers", "Peers in this node's view of the mesh", len(peers)))
        revoked = counter(
            "meshnode_revoked_credential_refusals_total",
            "Frames and streams refused to removed members, withdrawn invites and expired certificates",
        )
        for code, count in sorted(node.revoked_refusals().items()):
            revoked.add(count, {"code": code.removeprefix("MESH_ERROR_")})
        families.append(revoked)
        relays = node.relay_links
        if relays is not None:
            stats = relays.stats
            sent = counter("meshnode_relay_bytes_total", "Sealed bytes through relays")
            sent.add(stats.bytes_sent, {"direction": "sent"}).add(
                stats.bytes_received, {"direction": "received"}
            )
            families += [
                sent,
                counter(
                    "meshnode_relay_frames_dropped_total",
                    "Relayed frames that failed to open (tampered, replayed, forged)",
                    stats.frames_dropped,
                ),
                counter(
                    "meshnode_relay_frames_refused_total", "Frames a relay refused", stats.refused_frames
                ),
                gauge(
                    "meshnode_relays_registered",
                    "Relays this node is registered with",
                    len(relays.registered_relays()),
                ),
            ]
    server = sources.server
    if server is not None:
        load = server.load()
        health = await server.engine_health()
        state = gauge("meshnode_serving_state", "1 for the current serving state")
        for value, name in _SERVING_STATES.items():
            state.add(1 if load.serving_state == value else 0, {"state": name})
        families += [
            gauge(
                "meshnode_sessions_active", "Route sessions holding state on this shard", load.active_sessions
            ),
            gauge("meshnode_queue_depth", "Units of work queued for the engine", load.queued_units),
            gauge("meshnode_units_running", "Units of work executing", load.running_units),
            state,
            gauge("meshnode_kv_pressure", "Fraction of the KV cache in use (0..1)", health.kv_pressure),
            gauge("meshnode_kv_tokens_used", "KV cache tokens in use", health.kv_tokens_used),
            gauge("meshnode_kv_tokens_capacity", "KV cache tokens available", health.kv_tokens_capacity),
            gauge(
                "meshnode_resident_bytes",
                "Resident memory of the engine's process (VmRSS where the OS reports it)",
                health.resident_bytes,
            ),
        ]
        families += _memory_families(shard_memory())
        errors = counter("meshnode_shard_errors_total", "Refusals this shard sent, by error code")
        for code in shard.ErrorCode.values():
            if code != shard.ERROR_CODE_UNSPECIFIED:
                name = shard.ErrorCode.Name(code).removeprefix("ERROR_CODE_")
                errors.add(server.errors_sent.get(code, 0), {"code": name})
        engine_events = counter("meshnode_engine_events_total", "Engine counters (steps, tokens, sessions)")
        for name, value in sorted(server.engine.metrics().counters.items()):
            engine_events.add(value, {"event": name})
        families += [errors, engine_events, *_lease_families(server.worker)]
        families += _batch_families(server.worker, now)
    driver = sources.driver
    if driver is not None:
        stats = driver.stats
        outcomes = counter("meshnode_generations_total", "Generations by outcome")
        for outcome in ("completed", "cancelled", "closed", "failed"):
            outcomes.add(getattr(stats, outcome), {"outcome": outcome})
        families += [
            outcomes,
            gauge("meshnode_generations_active", "Generations running", stats.active),
            counter("meshnode_tokens_generated_total", "Tokens generated for API clients", stats.tokens),
            gauge(
                "meshnode_tokens_per_second",
                "Tokens generated per second since the previous scrape",
                sources.tokens_per_second(now, stats.tokens),
            ),
            counter("meshnode_reroutes_total", "Routes re-planned after a failed hop", stats.reroutes),
            counter("meshnode_cache_rebuilds_total", "Re-prefills after a cache miss", stats.rebuilds),
        ]
    return families


def _memory_families(memory: ShardMemory | None) -> list[Family]:
    """The process's resident memory against the budget of the shards loaded in it."""
    if memory is None:
        return []
    budget = gauge(
        "meshnode_shard_memory_budget_bytes",
        "What the loaded shards should hold, by buffer (as llama.cpp reports them)",
    )
    for name, value in memory.to_json()["budget"].items():
        budget.add(value, {"buffer": name.removesuffix("_bytes")})
    return [
        gauge(
            "meshnode_resident_file_bytes",
            "File-backed part of the process's resident memory (mapped model files)",
            memory.process.file_bytes,
        ),
        gauge(
            "meshnode_shard_resident_bytes",
            "The shards' resident share: mapped model files, and anonymous memory gained since the first load",
            memory.shard_bytes,
        ),
        budget,
    ]


def _lease_families(worker: Any) -> list[Family]:
    """Session leases at the shard (meshnode.dataplane.lease): releases by reason, share refusals."""
    from meshnode.dataplane.lease import ReleaseReason

    releases = counter("meshnode_session_releases_total", "Route sessions this shard ended, by reason")
    for reason in ReleaseReason:
        releases.add(worker.releases.get(reason, 0), {"reason": reason.value})
    refused = counter(
        "meshnode_session_share_refusals_total",
        "Sessions refused to a peer that already held its share of this shard's sessions",
        worker.share_refusals,
    )
    return [releases, refused]


def _batch_families(worker: Any, now: float) -> list[Family]:
    """The shard's engine batches (meshnode.dataplane.batch_stats): sizes, queue waits, busy time.

    ``now``: the monotonic clock in seconds, the clock the worker counts busy time on."""
    from meshnode.sansio import SECOND_NS

    stats = worker.batch_stats
    busy_s = stats.busy_ns_at(round(now * SECOND_NS)) / SECOND_NS
    units = counter("meshnode_batch_units_total", "Units of work run in engine batches, by kind")
    units.add(stats.decode_units, {"kind": "decode"}).add(stats.prefill_units, {"kind": "prefill"})
    return [
        counter("meshnode_batches_total", "Engine batches this shard ran", stats.batches),
        units,
        counter("meshnode_batch_tokens_total", "Tokens in engine batches", stats.tokens),
        histogram(
            "meshnode_batch_size",
            "Units of work per engine batch",
            stats.sizes.cumulative(),
            stats.sizes.total,
        ),
        histogram(
            "meshnode_queue_wait_seconds",
            "From a unit's arrival to the start of the engine batch that runs it",
            stats.queue_wait_s.cumulative(),
            stats.queue_wait_s.total,
        ),
        counter("meshnode_engine_busy_seconds_total", "Time this shard's engine spent on batches", busy_s),
        gauge(
            "meshnode_engine_busy_fraction",
            "Share of the last 10 s this shard's engine spent on batches (0..1)",
            stats.busy_fraction(round(now * SECOND_NS)),
        ),
    ]


def _frame_buffer_families() -> list[Family]:
    """Incomplete frames, process-wide (meshnode.transport.read_limits): bytes held, streams given up."""
    from meshnode.transport.read_limits import process_budget, reset_counts

    resets = counter(
        "meshnode_frame_resets_total",
        "Streams reset for holding too much of an incomplete frame (per connection, per process) "
        "or stalling mid-frame, by reason",
    )
    for reason, value in reset_counts().items():
        resets.add(value, {"reason": reason})
    budget = process_budget()
    return [
        resets,
        gauge("meshnode_frame_buffer_bytes", "Bytes held in incomplete frames, all connections", budget.held),
        gauge("meshnode_frame_buffer_limit_bytes", "Cap on meshnode_frame_buffer_bytes", budget.limit),
    ]
