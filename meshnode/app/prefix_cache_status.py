"""The ``prefix_cache`` section of ``meshnode status``: what a node's shard keeps of released
sessions' prompts (engines.session_table) and how often a new prompt started from it.

The section is the engine's prefix counters as they stand, read at every report;
meshnode.app.status prints it (without importing this module: the engine's names bring numpy,
which ``meshnode status`` does not load).
"""

from __future__ import annotations

from collections.abc import Mapping

from engines.interface import (
    METRIC_PREFIX_ENTRIES,
    METRIC_PREFIX_EVICTED,
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_KEPT,
    METRIC_PREFIX_MISSES,
    METRIC_PREFIX_TOKENS_REUSED,
)

PREFIX_CACHE_SECTION = "prefix_cache"

# The section's keys for the engine's counters, in the order the line says them.
_COUNTERS = {
    "hits": METRIC_PREFIX_HITS,
    "misses": METRIC_PREFIX_MISSES,
    "tokens_reused": METRIC_PREFIX_TOKENS_REUSED,
    "kept": METRIC_PREFIX_KEPT,
    "evicted": METRIC_PREFIX_EVICTED,
}


def prefix_cache_section(counters: Mapping[str, int], limit: int) -> dict[str, int]:
    """The section of a shard that keeps at most ``limit`` prefixes (0: the cache is off), from
    its engine's counters: the prefixes kept now, and since the load: prompts started from one
    (hits), starts that found none (misses), the positions not computed again, released sessions
    kept, and kept prefixes dropped for room or age."""
    section = {"limit": limit, "entries": counters.get(METRIC_PREFIX_ENTRIES, 0)}
    section.update({key: counters.get(metric, 0) for key, metric in _COUNTERS.items()})
    return section


__all__ = ["PREFIX_CACHE_SECTION", "prefix_cache_section"]
