"""``meshnode status`` shows what a node's shard keeps of released prompts (the prefix cache's
section, meshnode.app.prefix_cache_status): on a node, on a ``meshnode serve`` process, and
nothing where a node serves no shard."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines.interface import (
    METRIC_PREFILL_STEPS,
    METRIC_PREFIX_ENTRIES,
    METRIC_PREFIX_EVICTED,
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_KEPT,
    METRIC_PREFIX_MISSES,
    METRIC_PREFIX_TOKENS_REUSED,
)
from meshnode.app.prefix_cache_status import PREFIX_CACHE_SECTION, prefix_cache_section
from meshnode.app.standalone_status import answer_standalone_status
from meshnode.app.status import format_status
from meshnode.statussocket.client import query_status
from meshnode.wire.pb import mesh

COUNTERS = {
    METRIC_PREFIX_ENTRIES: 3,
    METRIC_PREFIX_HITS: 12,
    METRIC_PREFIX_MISSES: 4,
    METRIC_PREFIX_TOKENS_REUSED: 5120,
    METRIC_PREFIX_KEPT: 20,
    METRIC_PREFIX_EVICTED: 17,
    METRIC_PREFILL_STEPS: 99,  # not the cache's: left out
}


def node_status(sections: dict) -> dict:
    node = {
        "short_id": "aaaa",
        "mesh_id": "m1",
        "member": True,
        "addresses": ["127.0.0.1:1"],
        "serving": None,
    }
    return {"node": node, "peers": [], "sections": sections}


def test_the_section_is_the_engines_prefix_counters_and_the_limit():
    assert prefix_cache_section(COUNTERS, 8) == {
        "limit": 8,
        "entries": 3,
        "hits": 12,
        "misses": 4,
        "tokens_reused": 5120,
        "kept": 20,
        "evicted": 17,
    }
    # An engine that has counted nothing yet (or one without a prefix cache) reads as zeros.
    assert set(prefix_cache_section({}, 0).values()) == {0}


def test_a_nodes_status_says_how_many_prefixes_its_shard_keeps_and_how_they_served():
    text = format_status(node_status({PREFIX_CACHE_SECTION: prefix_cache_section(COUNTERS, 8)}))
    assert "  prefix cache: 3 of 8 kept; 12 hits, 4 misses, 5120 tokens reused" in text.splitlines()
    off = format_status(node_status({PREFIX_CACHE_SECTION: prefix_cache_section({}, 0)}))
    assert "  prefix cache: off" in off.splitlines()
    # A placed node that serves nothing yet reports an empty section; an older node none.
    for sections in ({PREFIX_CACHE_SECTION: {}}, {}):
        assert "prefix cache" not in format_status(node_status(sections))


async def test_a_standalone_server_reports_its_shards_prefix_cache(tmp_path: Path):
    served = mesh.PeerAnnouncement(endpoint_id=b"\x01" * 32)
    served.serving.model_name = "tiny"
    served.serving.shard_range.end_layer = 6
    served.serving.total_layers = 6
    counters = dict(COUNTERS)
    server = await answer_standalone_status(
        tmp_path, "http://127.0.0.1:1", served, lambda: prefix_cache_section(counters, 8)
    )
    assert server is not None
    try:
        status = await asyncio.to_thread(query_status, tmp_path, 2.0)
        assert status["sections"][PREFIX_CACHE_SECTION]["entries"] == 3
        assert "  prefix cache: 3 of 8 kept; 12 hits, 4 misses, 5120 tokens reused" in format_status(status)
        counters[METRIC_PREFIX_HITS] = 13  # read at every report, not once
        status = await asyncio.to_thread(query_status, tmp_path, 2.0)
        assert status["sections"][PREFIX_CACHE_SECTION]["hits"] == 13
    finally:
        server.close()
