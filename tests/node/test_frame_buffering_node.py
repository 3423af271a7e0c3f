"""A member cannot make a running `meshnode` process reserve memory by announcing frames.

The node under test is a real ``meshnode create`` process (no model); the
attacker is an admitted member in this process, opening raw QUIC streams on its
own authenticated link. Each stream sends a stream-type byte, a length prefix
announcing a maximal (8 MiB) frame and a few body bytes, then stalls. Before
frame buffers grew with the bytes that arrive, every such header made the node
allocate (and zero-fill) the announced length: measured on a 2-core machine,
64 streams took the node's VmRSS from 77 to 590 MiB (+513 MiB). Now the node
holds only the bytes that came (78 -> 78 MiB measured), resets every stalled
stream with its handler's read timeout, and keeps answering a well-behaved
peer throughout.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from helpers.mesh_helpers import reset_code_of
from helpers.mesh_nodes import fast_config, start_invited_node
from helpers.node_processes import NodeProcess
from helpers.polling import eventually
from helpers.rss import MiB, PeakRss

from meshnode.node import Node
from meshnode.statussocket.client import query_status
from meshnode.transport.base import MeshStream
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STREAMS = 64
RSS_GROWTH_LIMIT = 64 * MiB
# The target's gossip handler gives a frame this long; the stalled streams end with it.
GOSSIP_TIMEOUT_S = 3.0


async def announce_and_stall(stream: MeshStream) -> int:
    """Type byte, an 8 MiB length prefix and 3 body bytes; then wait for the node's reset code."""
    await stream.write(bytes([StreamType.GOSSIP]) + MAX_FRAME_BYTES.to_bytes(4, "little") + b"abc")
    return await reset_code_of(stream, 4 * GOSSIP_TIMEOUT_S)


async def test_announced_frames_do_not_reserve_memory_and_the_node_keeps_answering(tmp_path: Path) -> None:
    target = NodeProcess(tmp_path, "target")
    target.start(
        "create",
        *("--listen", "127.0.0.1:0", "--heartbeat-interval", "0.5"),
        *("--gossip-timeout", str(GOSSIP_TIMEOUT_S), "--probe-timeout", "2"),
    )
    process, data_dir = target.process, target.data_dir
    nodes: list[Node] = []
    try:
        await eventually(target.live_status, 30, "the target to answer status", interval=0.1)
        target_id = target.node_id()
        invite = target.invite()
        for name in ("good", "attacker"):
            nodes.append(
                await start_invited_node(tmp_path / name, fast_config(heartbeat_interval=0.5), invite)
            )
        good, attacker = nodes
        link = await attacker.get_link(target_id)
        assert await good.probe(target_id)

        probes: Counter[bool] = Counter()
        attack_over = asyncio.Event()

        async def keep_probing() -> None:
            while not attack_over.is_set():
                probes[await good.probe(target_id)] += 1
                await asyncio.sleep(0.1)

        await asyncio.sleep(1.0)  # let the target settle after the joins before the baseline
        async with PeakRss(process.pid) as rss:
            prober = asyncio.create_task(keep_probing())
            streams = [await link.open_raw_stream() for _ in range(STREAMS)]
            codes = await asyncio.gather(*(announce_and_stall(s) for s in streams))
            attack_over.set()
            await prober
        print(json.dumps({"streams": STREAMS, "rss": rss.describe(), "probes": dict(probes)}))

        assert process.poll() is None, "the node died"
        assert rss.growth < RSS_GROWTH_LIMIT, rss.describe()
        # Each stalled frame ends with the gossip handler's read timeout, nothing worse.
        assert codes == [mesh.MESH_ERROR_READ_TIMEOUT] * STREAMS
        assert probes[True] >= 3 and probes[False] == 0, probes
        assert await good.probe(target_id)
        assert good.identity.short_id in {p["short_id"] for p in query_status(data_dir)["peers"]}
        assert not link.is_closed
    finally:
        for node in nodes:
            await node.shutdown()
        target.stop()
