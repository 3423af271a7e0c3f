"""A node's Prometheus metrics for ``GET /metrics``, through prometheus_client.

Most values are read from the live objects at scrape time — the node, its shard
server and engine, the head, the relay links — by a collector, rather than mirrored
into metric objects on every event, so the hot path does no metrics work beyond the
few counters those objects keep anyway. Every such value is a counter or a gauge of
the moment: a rate is the scraper's to compute (``rate(meshnode_completion_tokens_total[1m])``),
so any number of scrapers see the same numbers.

Latencies cannot be read afterwards, so the head's generation driver hands each
token's timing to :meth:`NodeMetrics.observe_token`, which feeds two histograms.

Each node keeps its own :class:`~prometheus_client.CollectorRegistry` (several nodes
run in one test process; the global registry would mix them).
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from engines.interface import (
    METRIC_CACHE_MISSES,
    METRIC_DECODE_STEPS,
    METRIC_ERRORS,
    METRIC_PREFILL_STEPS,
    METRIC_PREFIX_ENTRIES,
    METRIC_PREFIX_EVICTED,
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_KEPT,
    METRIC_PREFIX_MISSES,
    METRIC_PREFIX_TOKENS_REUSED,
    METRIC_SESSIONS_CANCELLED,
    METRIC_SESSIONS_EVICTED,
    METRIC_SESSIONS_EXPIRED,
    METRIC_SESSIONS_OPENED,
    METRIC_SESSIONS_RELEASED,
    METRIC_STEPS_CANCELLED,
    METRIC_TOKENS_PROCESSED,
    EngineHealth,
)
from engines.resident_memory import ShardMemory, shard_memory
from meshnode.identity import short_id

# What generate_latest writes (names escaped to the classic character set) is the 0.0.4 text format.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Seconds. A first token waits for the whole prompt's prefill along the route; later tokens
# take one decode step per hop, so the second histogram's buckets start far lower.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_SERVING_STATES = {1: "serving", 2: "draining", 3: "not_serving"}
_ENGINE_STEP_KINDS = {METRIC_PREFILL_STEPS: "prefill", METRIC_DECODE_STEPS: "decode"}
_ENGINE_SESSION_ENDS = {
    METRIC_SESSIONS_RELEASED: "released",
    METRIC_SESSIONS_EVICTED: "evicted",
    METRIC_SESSIONS_EXPIRED: "expired",
    METRIC_SESSIONS_CANCELLED: "cancelled",
}
_ENGINE_SINGLE_COUNTERS = {
    METRIC_STEPS_CANCELLED: ("meshnode_engine_steps_cancelled_total", "Engine steps cancelled mid-run"),
    METRIC_TOKENS_PROCESSED: ("meshnode_engine_tokens_processed_total", "Tokens the engine computed"),
    METRIC_CACHE_MISSES: (
        "meshnode_engine_cache_misses_total",
        "Steps that found no cached session state (the head re-prefills)",
    ),
    METRIC_SESSIONS_OPENED: ("meshnode_engine_sessions_opened_total", "Engine sessions opened"),
    METRIC_ERRORS: ("meshnode_engine_errors_total", "Engine steps that failed"),
}
# The shard's prefix cache (engines.session_table): released sessions' whole prefill blocks kept
# in their slots, from which a later prompt that starts the same way opens its session.
_ENGINE_PREFIX_COUNTERS = {
    METRIC_PREFIX_HITS: (
        "meshnode_prefix_cache_hits_total",
        "Sessions this shard opened from a kept prefix instead of computing it again",
    ),
    METRIC_PREFIX_MISSES: (
        "meshnode_prefix_cache_misses_total",
        "Sessions asked to open from a kept prefix this shard no longer held (the head prefills "
        "from the first token)",
    ),
    METRIC_PREFIX_TOKENS_REUSED: (
        "meshnode_prefix_cache_tokens_reused_total",
        "Positions sessions opened from kept prefixes did not compute again",
    ),
    METRIC_PREFIX_KEPT: (
        "meshnode_prefix_cache_kept_total",
        "Released sessions whose whole prefill blocks this shard kept",
    ),
    METRIC_PREFIX_EVICTED: (
        "meshnode_prefix_cache_evicted_total",
        "Kept prefixes dropped to make room for a session or after going unused too long",
    ),
}


@dataclass
class MetricSources:
    """The live objects a node's ``/metrics`` reads; any may be absent."""

    node: Any = None  # meshnode.node.Node
    server: Any = None  # meshnode.dataplane.edges.server.ShardServer
    driver: Any = None  # meshnode.head.driver.GenerationDriver
    routes: Any = None  # meshnode.head.route_backend.RouteBackend
    slow_stages: Any = None  # meshnode.mesh.slow_stage.SlowStageWatch


class NodeMetrics:
    """One node's registry: the live objects read at scrape time, and the token latency histograms."""

    def __init__(self, sources: MetricSources) -> None:
        self.sources = sources
        self.registry = CollectorRegistry(auto_describe=False)
        self._live = _LiveObjects(sources)
        self.registry.register(self._live)
        self.time_to_first_token = Histogram(
            "meshnode_time_to_first_token_seconds",
            "From a generation's start at the head to its first token",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "meshnode_inter_token_latency_seconds",
            "Between consecutive tokens of a generation",
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_token(self, first: bool, seconds: float) -> None:
        """A generation yielded a token ``seconds`` after its start (``first``) or its previous token."""
        (self.time_to_first_token if first else self.inter_token_latency).observe(seconds)

    async def exposition(self) -> bytes:
        """The registry in the text format (:data:`CONTENT_TYPE`)."""
        server = self.sources.server
        if server is not None:
            self._live.health = await server.engine_health()
        return generate_latest(self.registry)


class _LiveObjects:
    """A collector over :class:`MetricSources` (prometheus_client calls ``collect`` per exposition)."""

    def __init__(self, sources: MetricSources) -> None:
        self.sources = sources
        # The one value that has to be awaited (the engine answers from its thread): read before
        # each exposition, since prometheus_client's collectors are synchronous.
        self.health: EngineHealth | None = None

    def collect(self) -> Iterator[Metric]:
        yield from live_families(self.sources, self.health, now=time.monotonic())


async def collect(sources: MetricSources, *, now: float) -> list[Metric]:
    """What a scrape at monotonic time ``now`` reads of ``sources`` (the latency histograms aside)."""
    health = await sources.server.engine_health() if sources.server is not None else None
    return live_families(sources, health, now=now)


def samples_by_name(families: Sequence[Metric]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name, as exposed (a counter's ends in ``_total``): [(labels, value), ...]}."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in families:
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def live_families(sources: MetricSources, health: EngineHealth | None, *, now: float) -> list[Metric]:
    """``health``: the shard engine's, read by the caller (the engine is asked asynchronously)."""
    from meshnode import __version__

    families: list[Metric] = [_gauge("meshnode_up", "1 while the node answers", 1)]
    identity = {"version": __version__}
    node = sources.node
    if node is not None:
        identity.update(node_id=node.node_id.hex()[:16], mesh_id=node.mesh_id or "")
    families.append(
        _labelled(GaugeMetricFamily, "meshnode_info", "Build and identity labels", [(identity, 1)])
    )
    families.append(
        _labelled(
            GaugeMetricFamily,
            "meshnode_build_info",
            "1, labelled with this build's version and the llama.cpp binding it runs",
            [({"version": __version__, "llama_cpp": _llama_cpp_version()}, 1)],
        )
    )
    families += _frame_buffer_families()
    if node is not None:
        families += _node_families(node)
    server = sources.server
    if server is not None:
        families += _server_families(server, health, now)
    driver = sources.driver
    if driver is not None:
        families += _driver_families(driver.stats)
    if sources.routes is not None:
        families += _route_families(sources.routes.route_times())
    if sources.slow_stages is not None:
        families += _slow_stage_families(sources.slow_stages)
    return families


def _route_families(times: Sequence[Any]) -> list[Metric]:
    """What the route a request would take now is expected to take per token, by model
    (meshnode.head.route_time); a route some hop of which announces no speed is left out."""
    known = [(time.model_name, time.decode_ms_per_token) for time in times]
    return [
        _labelled(
            GaugeMetricFamily,
            "meshnode_route_expected_seconds_per_token",
            "The announced decode time of the route a request would take now, its hops' links "
            "included, by model",
            [({"model": model}, step / 1_000) for model, step in known if step is not None],
        )
    ]


def _slow_stage_families(watch: Any) -> list[Metric]:
    """The stages this node compares (meshnode.mesh.slow_stage): each one's time for its work
    against the others', and whether it has been slow long enough to say so."""
    compared = [watch.verdict(node_id) for node_id in watch.compared_nodes()]
    return [
        _labelled(
            GaugeMetricFamily,
            "meshnode_stage_time_ratio",
            "A stage's decode time for the work it holds over the median of the other stages' "
            "of its model, by node",
            [({"node": short_id(verdict.node_id)}, verdict.ratio) for verdict in compared],
        ),
        _labelled(
            GaugeMetricFamily,
            "meshnode_stage_slow",
            "1 for a stage that has been far slower than the others for long enough to slow every "
            "route through it, by node",
            [({"node": short_id(verdict.node_id)}, int(verdict.slow)) for verdict in compared],
        ),
    ]


@functools.cache
def _llama_cpp_version() -> str:
    # From the installed distribution's metadata: importing llama_cpp would load the native library.
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    samples: Sequence[tuple[Mapping[str, str], float]],
) -> Metric:
    """A family whose samples carry labels (every sample the same label names)."""
    names = list(samples[0][0]) if samples else []
    family = kind(name, doc, labels=names)
    for labels, value in samples:
        family.add_metric([labels[key] for key in names], value)
    return family


def _histogram(name: str, doc: str, cumulative: Sequence[tuple[float, int]], total: float) -> Metric:
    """``cumulative``: (upper bound, observations at or below it), ending with +Inf."""
    buckets = [(floatToGoString(bound), count) for bound, count in cumulative]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


def _node_families(node: Any) -> list[Metric]:
    families: list[Metric] = [
        _gauge("meshnode_peers", "Peers in this node's view of the mesh", len(node.peers())),
        _labelled(
            CounterMetricFamily,
            "meshnode_revoked_credential_refusals_total",
            "Frames and streams refused to removed members, withdrawn invites and expired certificates",
            [
                ({"code": code.removeprefix("MESH_ERROR_")}, count)
                for code, count in sorted(node.revoked_refusals().items())
            ],
        ),
    ]
    families += _traversal_families(node)
    relays = node.relay_links
    if relays is not None:
        stats = relays.stats
        families += [
            _labelled(
                CounterMetricFamily,
                "meshnode_relay_bytes_total",
                "Sealed bytes through relays",
                [
                    ({"direction": "sent"}, stats.bytes_sent),
                    ({"direction": "received"}, stats.bytes_received),
                ],
            ),
            _counter(
                "meshnode_relay_frames_dropped_total",
                "Relayed frames that failed to open (tampered, replayed, forged)",
                stats.frames_dropped,
            ),
            _counter("meshnode_relay_frames_refused_total", "Frames a relay refused", stats.refused_frames),
            _gauge(
                "meshnode_relays_registered",
                "Relays this node is registered with",
                len(relays.registered_relays()),
            ),
        ]
    return families


def _traversal_families(node: Any) -> list[Metric]:
    """Hole punching by outcome, direct paths lost, and the bytes links carried direct and relayed."""
    from meshnode.wire.framing import ALPN

    traversal = node.traversal
    attempts = sorted(traversal.attempts.items())
    families: list[Metric] = [
        _labelled(
            CounterMetricFamily,
            "meshnode_hole_punch_attempts_total",
            "Hole-punching attempts this node took part in, by its role and how they ended",
            [({"role": role, "outcome": outcome}, count) for (role, outcome), count in attempts],
        ),
        _counter(
            "meshnode_direct_paths_lost_total",
            "Direct paths to peers behind NAT given up for the relay (silent, or unanswered)",
            traversal.paths_lost,
        ),
    ]
    samples: list[tuple[Mapping[str, str], float]] = []
    if node.endpoint is not None:
        sent, received = node.endpoint.traffic(ALPN)
        samples += [({"path": "direct", "direction": "sent"}, sent)]
        samples += [({"path": "direct", "direction": "received"}, received)]
    relays = node.relay_links
    if relays is not None:
        samples += [({"path": "relayed", "direction": "sent"}, relays.stats.bytes_sent)]
        samples += [({"path": "relayed", "direction": "received"}, relays.stats.bytes_received)]
    families.append(
        _labelled(
            CounterMetricFamily,
            "meshnode_link_bytes_total",
            "Bytes of the links to peers: direct (QUIC datagrams) and relayed (sealed records)",
            samples,
        )
    )
    return families


def _server_families(server: Any, health: EngineHealth | None, now: float) -> list[Metric]:
    from meshnode.wire.pb import shard

    load = server.load()
    families: list[Metric] = [
        _gauge(
            "meshnode_sessions_active", "Route sessions holding state on this shard", load.active_sessions
        ),
        _gauge("meshnode_queue_depth", "Units of work queued for the engine", load.queued_units),
        _gauge("meshnode_units_running", "Units of work executing", load.running_units),
        _labelled(
            GaugeMetricFamily,
            "meshnode_serving_state",
            "1 for the current serving state",
            [({"state": name}, int(load.serving_state == value)) for value, name in _SERVING_STATES.items()],
        ),
    ]
    if health is not None:
        families += [
            _gauge(
                "meshnode_kv_cache_usage_ratio",
                "Fraction of this shard's KV cache in use (0..1)",
                health.kv_pressure,
            ),
            # The same fraction under its earlier name, which dashboards and alerts use.
            _gauge("meshnode_kv_pressure", "Fraction of the KV cache in use (0..1)", health.kv_pressure),
            _gauge("meshnode_kv_tokens_used", "KV cache tokens in use", health.kv_tokens_used),
            _gauge("meshnode_kv_tokens_capacity", "KV cache tokens available", health.kv_tokens_capacity),
            _gauge(
                "meshnode_resident_bytes",
                "Resident memory of the engine's process (VmRSS where the OS reports it)",
                health.resident_bytes,
            ),
        ]
    families += _memory_families(shard_memory())
    errors = []
    for code in shard.ErrorCode.values():
        if code != shard.ERROR_CODE_UNSPECIFIED:
            name = shard.ErrorCode.Name(code).removeprefix("ERROR_CODE_")
            errors.append(({"code": name}, server.errors_sent.get(code, 0)))
    families.append(
        _labelled(
            CounterMetricFamily,
            "meshnode_shard_errors_total",
            "Refusals this shard sent, by error code",
            errors,
        )
    )
    families += _engine_families(server.engine.metrics().counters)
    families += _lease_families(server.worker)
    families += _batch_families(server.worker, now)
    return families


def _engine_families(counters: Mapping[str, int]) -> list[Metric]:
    """The engine's own counters, one family per kind of thing counted (steps, tokens, sessions)."""
    families: list[Metric] = [
        _labelled(
            CounterMetricFamily,
            "meshnode_engine_steps_total",
            "Engine steps run, by kind",
            [({"kind": kind}, counters.get(key, 0)) for key, kind in _ENGINE_STEP_KINDS.items()],
        ),
        _labelled(
            CounterMetricFamily,
            "meshnode_engine_sessions_ended_total",
            "Engine sessions ended, by reason",
            [({"reason": reason}, counters.get(key, 0)) for key, reason in _ENGINE_SESSION_ENDS.items()],
        ),
    ]
    for key, (name, doc) in (_ENGINE_SINGLE_COUNTERS | _ENGINE_PREFIX_COUNTERS).items():
        families.append(_counter(name, doc, counters.get(key, 0)))
    families.append(
        _gauge(
            "meshnode_prefix_cache_entries",
            "Prefixes this shard keeps now, each in the KV slot of an idle session",
            counters.get(METRIC_PREFIX_ENTRIES, 0),
        )
    )
    known = (
        _ENGINE_STEP_KINDS.keys()
        | _ENGINE_SESSION_ENDS.keys()
        | _ENGINE_SINGLE_COUNTERS.keys()
        | _ENGINE_PREFIX_COUNTERS.keys()
        | {METRIC_PREFIX_ENTRIES}
    )
    others = [({"event": key}, value) for key, value in sorted(counters.items()) if key not in known]
    if others:
        # An engine may count more than the interface names; shown rather than lost.
        families.append(
            _labelled(
                CounterMetricFamily,
                "meshnode_engine_other_events_total",
                "Engine counters this node does not know by name",
                others,
            )
        )
    return families


def _driver_families(stats: Any) -> list[Metric]:
    """The head's generations (meshnode.head.driver.DriverStats)."""
    return [
        _labelled(
            CounterMetricFamily,
            "meshnode_generations_total",
            "Generations by outcome",
            [
                ({"outcome": outcome}, getattr(stats, outcome))
                for outcome in ("completed", "cancelled", "closed", "failed")
            ],
        ),
        _gauge("meshnode_generations_active", "Generations running", stats.active),
        _counter(
            "meshnode_prompt_tokens_total",
            "Prompt tokens of the generations this head started",
            stats.prompt_tokens,
        ),
        _counter(
            "meshnode_prompt_tokens_cached_total",
            "Prompt tokens this head did not prefill again: the route's hops kept them from an "
            "earlier generation (the API's usage.prompt_tokens_details.cached_tokens)",
            stats.prefix_cached_tokens,
        ),
        _counter(
            "meshnode_head_prefix_cache_hits_total",
            "Prefills this head started from a prefix the route's hops kept",
            stats.prefix_hits,
        ),
        _counter(
            "meshnode_head_prefix_cache_misses_total",
            "Prefills from a kept prefix that a hop no longer held (each prefilled again from the "
            "first token)",
            stats.prefix_misses,
        ),
        _counter(
            "meshnode_head_prefix_route_preferred_total",
            "Routes this head chose over a cheaper one for the prefix their hops kept",
            stats.prefix_route_preferred,
        ),
        _counter(
            "meshnode_head_prefix_answers_kept_total",
            "Answers this head prefilled after their kept prompts once they ended, so that a chat's "
            "next turn starts after both",
            stats.answers_kept,
        ),
        _counter(
            "meshnode_head_prefix_answer_tokens_kept_total",
            "Tokens of those answers (prefilled in the background, not before a first token)",
            stats.answer_tokens_kept,
        ),
        _counter(
            "meshnode_head_prefix_answers_not_kept_total",
            "Answers not kept after their prompts: a hop had no session to spare or no longer held the "
            "prompt, or the route failed",
            stats.answers_not_kept,
        ),
        _counter("meshnode_completion_tokens_total", "Tokens generated for API clients", stats.tokens),
        # The same count under its earlier name, which dashboards and alerts use.
        _counter("meshnode_tokens_generated_total", "Tokens generated for API clients", stats.tokens),
        _counter("meshnode_reroutes_total", "Routes re-planned after a failed hop", stats.reroutes),
        _counter("meshnode_cache_rebuilds_total", "Re-prefills after a cache miss", stats.rebuilds),
        _labelled(
            CounterMetricFamily,
            "meshnode_routes_opened_total",
            "Routes this head opened (each epoch of each generation), by how their stages run: "
            "in pipeline cohorts, or every session in one batch a stage",
            [
                ({"pipeline": "cohorts"}, stats.routes_in_cohorts),
                ({"pipeline": "one_batch"}, stats.routes_in_one_batch),
            ],
        ),
        _gauge(
            "meshnode_route_pipeline_cohorts",
            "Pipeline cohorts of the last route this head opened (0: every session in one batch a stage)",
            stats.last_route_cohorts,
        ),
    ]


def _memory_families(memory: ShardMemory | None) -> list[Metric]:
    """The process's resident memory against the budget of the shards loaded in it."""
    if memory is None:
        return []
    budget = [
        ({"buffer": name.removesuffix("_bytes")}, value) for name, value in memory.to_json()["budget"].items()
    ]
    return [
        _gauge(
            "meshnode_resident_file_bytes",
            "File-backed part of the process's resident memory (mapped model files)",
            memory.process.file_bytes,
        ),
        _gauge(
            "meshnode_shard_resident_bytes",
            "The shards' resident share: mapped model files, and anonymous memory gained since the first load "
            "less the vocabularies' (meshnode_outside_shard_bytes)",
            memory.shard_bytes,
        ),
        _labelled(
            GaugeMetricFamily,
            "meshnode_outside_shard_bytes",
            "Anonymous memory gained since the first load that is not the shards', by what it is",
            [({"kind": name}, value) for name, value in memory.outside.items()],
        ),
        _labelled(
            GaugeMetricFamily,
            "meshnode_shard_memory_budget_bytes",
            "What the loaded shards should hold, by part (buffers as llama.cpp reports them; vocabulary and "
            "context tables as measured at load)",
            budget,
        ),
    ]


def _lease_families(worker: Any) -> list[Metric]:
    """Session leases at the shard (meshnode.dataplane.lease): releases by reason, share refusals."""
    from meshnode.dataplane.lease import ReleaseReason

    return [
        _labelled(
            CounterMetricFamily,
            "meshnode_session_releases_total",
            "Route sessions this shard ended, by reason",
            [({"reason": reason.value}, worker.releases.get(reason, 0)) for reason in ReleaseReason],
        ),
        _counter(
            "meshnode_session_share_refusals_total",
            "Sessions refused to a peer that already held its share of this shard's sessions",
            worker.share_refusals,
        ),
    ]


def _batch_families(worker: Any, now: float) -> list[Metric]:
    """The shard's engine batches (meshnode.dataplane.batch_stats): sizes, queue waits, busy time.

    ``now``: the monotonic clock in seconds, the clock the worker counts busy time on."""
    from meshnode.sansio import SECOND_NS

    stats = worker.batch_stats
    busy_s = stats.busy_ns_at(round(now * SECOND_NS)) / SECOND_NS
    return [
        _counter("meshnode_batches_total", "Engine batches this shard ran", stats.batches),
        _labelled(
            CounterMetricFamily,
            "meshnode_batch_units_total",
            "Units of work run in engine batches, by kind",
            [({"kind": "decode"}, stats.decode_units), ({"kind": "prefill"}, stats.prefill_units)],
        ),
        _counter("meshnode_batch_tokens_total", "Tokens in engine batches", stats.tokens),
        _histogram(
            "meshnode_batch_size",
            "Units of work per engine batch",
            stats.sizes.cumulative(),
            stats.sizes.total,
        ),
        _histogram(
            "meshnode_queue_wait_seconds",
            "From a unit's arrival to the start of the engine batch that runs it",
            stats.queue_wait_s.cumulative(),
            stats.queue_wait_s.total,
        ),
        _counter("meshnode_engine_busy_seconds_total", "Time this shard's engine spent on batches", busy_s),
        _gauge(
            "meshnode_engine_busy_fraction",
            "Share of the last 10 s this shard's engine spent on batches (0..1)",
            stats.busy_fraction(round(now * SECOND_NS)),
        ),
        *_stage_speed_families(stats.speed.speed()),
    ]


def _stage_speed_families(speed: Any) -> list[Metric]:
    """The range's step times this node announces (meshnode.dataplane.stage_speed); none before
    the validation's calibration."""
    if speed is None:
        return []
    source = "measured" if speed.measured else "calibrated"
    return [
        _labelled(
            GaugeMetricFamily,
            "meshnode_stage_seconds_per_token",
            "What a step of this shard's range takes per token, smoothed, by kind and source "
            "(prefill 0: none measured yet)",
            [
                ({"kind": "decode", "source": source}, speed.decode_us_per_token / 1e6),
                ({"kind": "prefill", "source": source}, speed.prefill_us_per_token / 1e6),
            ],
        ),
        _gauge(
            "meshnode_stage_speed_samples",
            "Engine batches this shard's announced step times are smoothed over",
            speed.samples,
        ),
    ]


def _frame_buffer_families() -> list[Metric]:
    """Incomplete frames, process-wide (meshnode.transport.read_limits): bytes held, streams given up."""
    from meshnode.transport.read_limits import process_budget, reset_counts

    budget = process_budget()
    return [
        _labelled(
            CounterMetricFamily,
            "meshnode_frame_resets_total",
            "Streams reset for holding too much of an incomplete frame (per connection, per process) "
            "or stalling mid-frame, by reason",
            [({"reason": reason}, value) for reason, value in reset_counts().items()],
        ),
        _gauge(
            "meshnode_frame_buffer_bytes", "Bytes held in incomplete frames, all connections", budget.held
        ),
        _gauge("meshnode_frame_buffer_limit_bytes", "Cap on meshnode_frame_buffer_bytes", budget.limit),
    ]


def render(families: Sequence[Metric]) -> str:
    """``families`` in the text format, as ``/metrics`` writes them (for tests and one-off views)."""
    return generate_latest(_Families(families)).decode()


class _Families:
    """A fixed list of families as a prometheus_client collector."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


__all__ = [
    "CONTENT_TYPE",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "MetricSources",
    "NodeMetrics",
    "collect",
    "live_families",
    "render",
    "samples_by_name",
]
