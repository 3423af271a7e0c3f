"""`meshnode status` while a node hashes its model and writes its slice, before it starts."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from helpers.mesh_nodes import fast_config, first_member

from engines.file_progress import FileProgress
from meshnode.app.preparation_status import LOADING_THE_SHARD, status_while_preparing
from meshnode.app.status import format_status
from meshnode.membership.credentials import MeshKey
from meshnode.statussocket.client import query_status
from meshnode.wire.pb import mesh

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


async def test_the_status_socket_answers_with_the_hashing_progress_before_the_node_starts(tmp_path: Path):
    node = first_member(tmp_path / "node", fast_config(), MeshKey.generate())
    clock = Clock()
    with pytest.raises(OSError):
        query_status(node.data_dir.path)  # nothing answers before
    async with status_while_preparing(node):
        with FileProgress("hashing big.gguf", 100 * MIB, stream=io.StringIO(), clock=clock) as hashing:
            hashing(10 * MIB)
            clock.now += 1.0
            hashing(15 * MIB)
            status = await asyncio.to_thread(query_status, node.data_dir.path)
    [listed] = status["sections"]["files"]["passes"]
    assert (listed["label"], listed["done_bytes"], listed["total_bytes"]) == (
        "hashing big.gguf",
        25 * MIB,
        100 * MIB,
    )
    text = format_status(status)
    assert f"node {node.identity.short_id}" in text
    assert "  preparing: hashing big.gguf: 25.0/100.0 MiB 25.0% 25.0 MiB/s ETA 3 s" in text
    assert f"  starting: {LOADING_THE_SHARD}" in text
    assert "startup" not in node.status().sections  # once the node starts, its report is its own
    with pytest.raises(OSError):
        query_status(node.data_dir.path)  # the node's own socket takes over when it starts


def test_no_line_when_nothing_is_being_prepared():
    node = {
        "short_id": "abc", "mesh_id": "m", "member": True, "addresses": ["127.0.0.1:1"], "serving": None,
        "api_url": None, "capacity": {}, "load": {},
    }  # fmt: skip
    assert "preparing" not in format_status(
        {"node": node, "peers": [], "sections": {"files": {"passes": []}}}
    )


async def test_a_loaded_shard_is_not_reported_as_served_before_the_node_starts(tmp_path: Path):
    """Scripts (and the test clusters) wait for ``serving`` and then read the node's addresses."""
    node = first_member(tmp_path / "node", fast_config(), MeshKey.generate())
    served = mesh.ServedShard(model_name="tiny", total_layers=6)
    served.shard_range.start_layer, served.shard_range.end_layer = 0, 3
    async with status_while_preparing(node):
        node.set_serving(served)  # what the shard service does once its shard has loaded
        status = await asyncio.to_thread(query_status, node.data_dir.path)
    assert status["node"]["serving"] is None
    assert status["sections"]["startup"]["state"] == LOADING_THE_SHARD
    assert node.status().node.serving is not None  # the node's own report, once started, says it
