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
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers.mesh_nodes import fast_config
from helpers.rss import MiB, PeakRss

from meshnode.app.status import query_status
from meshnode.identity import NodeIdentity, load_identity
from meshnode.membership.credentials import Endpoint, create_invite
from meshnode.membership.store import DataDir
from meshnode.node import Node
from meshnode.transport.base import MeshStream, StreamReset
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType
from meshnode.wire.mesh_refusal import refusal_from_reset_code
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STREAMS = 64
RSS_GROWTH_LIMIT = 64 * MiB
# The target's gossip handler gives a frame this long; the stalled streams end with it.
GOSSIP_TIMEOUT_S = 3.0


async def start_target(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, dict]:
    data_dir = tmp_path / "target"
    log = (tmp_path / "target.log").open("w")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshnode", "create", "--data-dir", str(data_dir)),
            *("--listen", "127.0.0.1:0", "--heartbeat-interval", "0.5"),
            *("--gossip-timeout", str(GOSSIP_TIMEOUT_S), "--probe-timeout", "2"),
        ],
        stdout=log,
        stderr=log,
    )
    log.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            return process, data_dir, query_status(data_dir)
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, "node did not start"
            await asyncio.sleep(0.1)


async def announce_and_stall(stream: MeshStream) -> int:
    """Type byte, an 8 MiB length prefix and 3 body bytes; then wait for the node's reset code."""
    await stream.write(bytes([StreamType.GOSSIP]) + MAX_FRAME_BYTES.to_bytes(4, "little") + b"abc")
    try:
        async with asyncio.timeout(4 * GOSSIP_TIMEOUT_S):
            while await stream.read():
                pass
    except StreamReset as exc:
        refusal = refusal_from_reset_code(exc.error_code)
        assert refusal is not None, f"reset 0x{exc.error_code:x} is not a mesh refusal"
        return refusal.code
    raise AssertionError("the node ended a stalled stream without resetting it")


async def test_announced_frames_do_not_reserve_memory_and_the_node_keeps_answering(tmp_path: Path) -> None:
    process, data_dir, status = await start_target(tmp_path)
    nodes: list[Node] = []
    try:
        target_id = load_identity(data_dir).node_id
        membership = DataDir(data_dir).load_membership(target_id)
        address = status["node"]["addresses"][0]
        invite = create_invite(
            membership.mesh_key,
            issuer_id=target_id,
            bootstrap=[Endpoint(target_id, address)],
            unix_now=time.time(),
        )
        for name in ("good", "attacker"):
            node = Node(
                NodeIdentity.generate(),
                DataDir(tmp_path / name),
                fast_config(heartbeat_interval=0.5),
                invite=invite,
            )
            nodes.append(node)
            await node.start()
            await node.join()
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
        process.terminate()
        process.wait(10)
