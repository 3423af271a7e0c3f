"""Acceptance (issue 23): an admitted member's forged record of another node changes nothing.

Two real ``meshnode`` processes on the tiny model over real QUIC: A serves layers
[0, 3) and the API, B serves [3, 6). The test process joins as an admitted member
and sends A GossipFrames carrying a forged copy of B's record — the issue's
forgery: incarnation raised by 10^15, B's address pointed at a closed port, B's
serving range removed — once with B's old signature, once unsigned. A must drop
both (counted by reason, logged naming the sender), keep B's real record, keep
taking B's own heartbeats, and keep answering completions.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.mesh_nodes import serving_peer
from helpers.node_processes import NodeProcess, QuicCluster, api_node_args
from helpers.polling import eventually
from helpers.tiny_llama import SPLIT

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.identity import short_id
from meshnode.mesh.signed_record import decode_record
from meshnode.node import Node
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "meshnode-tiny-llama-v1"
CLOSED_PORT_ADDRESS = "127.0.0.1:9"  # discard: nothing of ours listens there
COMPLETIONS_AFTER = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuicCluster]:
    """A [0, 3) with the API, B [3, 6) without."""
    splits = {"A": (0, SPLIT), "B": (SPLIT, TINY_N_LAYERS)}
    cluster = QuicCluster(
        tmp_path_factory.mktemp("forged"), ensure_tiny_model(), api_node_args(splits, ["A"])
    )
    with cluster.running(splits):
        yield cluster


@pytest.fixture
async def member(cluster: QuicCluster, tmp_path: Path) -> AsyncIterator[Node]:
    node = await cluster.client_node(tmp_path / "member")
    yield node
    await node.shutdown()


def status_of(process: NodeProcess) -> dict:
    status = process.status()
    assert status is not None, f"{process.data_dir.name} does not answer status"
    return status


def peer_in(status: dict, node_id: bytes) -> dict | None:
    return next((p for p in status["peers"] if p["id"] == node_id.hex()), None)


async def complete(api: str) -> str:
    body = {"model": MODEL, "prompt": "hello mesh", "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def api_ready(api: str) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{api}/v1/models") as response:
                if [m["id"] for m in (await response.json())["data"]] == [MODEL]:
                    return
            await asyncio.sleep(0.2)


def forged_record_of(real: mesh.SignedPeerRecord) -> bytes:
    forged = decode_record(real)
    forged.incarnation += 10**15
    forged.ClearField("addresses")
    forged.addresses.append(CLOSED_PORT_ADDRESS)
    forged.ClearField("serving")
    return forged.SerializeToString()


def frame_lying_about(member: Node, target: bytes, liar_id: bytes, signed: mesh.SignedPeerRecord) -> bytes:
    """The member's honest frame, with its copy of ``liar_id``'s record replaced by ``signed``."""
    frame = member.state.gossip_frame(target)
    entries = [e for e in frame.entries if bytes(decode_record(e.record).endpoint_id) != liar_id]
    del frame.entries[:]
    frame.entries.extend(entries)
    frame.entries.add().record.CopyFrom(signed)
    return frame.SerializeToString()


async def test_a_members_forged_record_of_another_node_is_refused_and_changes_nothing(cluster, member):
    a, b = cluster.processes
    a_id, b_id = bytes.fromhex(status_of(a)["node"]["id"]), bytes.fromhex(status_of(b)["node"]["id"])
    api = status_of(a)["node"]["api_url"]
    async with asyncio.timeout(60):
        await api_ready(api)
        assert (await serving_peer(member, SPLIT, TINY_N_LAYERS))[0] == b_id
    before_text = await complete(api)
    real_b = peer_in(status_of(a), b_id)
    assert real_b is not None and real_b["serving"]["start_layer"] == SPLIT

    real = member.state.table.get(b_id).record
    forged = forged_record_of(real)
    link = await member.get_link(a_id)
    for signed in (
        mesh.SignedPeerRecord(record=forged, signature=real.signature),  # B's signature, other bytes
        mesh.SignedPeerRecord(record=forged),  # no signature at all
    ):
        body = frame_lying_about(member, a_id, b_id, signed)
        reply = await request_reply(link, StreamType.GOSSIP, body, timeout=5.0)
        assert reply is not None
        # The member's own record was sound: A answers it as a member, refusing nothing.
        assert not mesh.GossipFrame.FromString(reply).HasField("refusal")

    status = status_of(a)
    assert status["refusals"]["records"] == {"bad_signature": 1, "unsigned": 1}
    held = peer_in(status, b_id)
    assert held is not None
    assert held["incarnation"] == real_b["incarnation"]
    assert held["addresses"] == real_b["addresses"] != [CLOSED_PORT_ADDRESS]
    assert held["serving"] == real_b["serving"]
    assert peer_in(status, member.node_id) is not None  # the liar is still a member: it was only lying

    log = a.log_path.read_text()
    dropped = [line for line in log.splitlines() if "dropped a record of " + short_id(b_id) in line]
    assert len(dropped) == 2, log[-3000:]
    assert all(line.endswith("sent by " + member.identity.short_id) for line in dropped)
    assert "bad_signature" in dropped[0] and "unsigned" in dropped[1]

    # `meshnode status` on A still lists B's real address and range.
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "meshnode", "status", "--data-dir", str(a.data_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    (b_line,) = [line for line in shown.stdout.splitlines() if line.strip().startswith(short_id(b_id))]
    assert real_b["addresses"][0] in b_line and f"[{SPLIT}:{TINY_N_LAYERS})" in b_line

    # B's own heartbeats still replace what A holds (nothing was pinned) and A keeps serving.
    await eventually(lambda: peer_in(status_of(a), b_id)["heartbeat_seq"] > held["heartbeat_seq"], timeout=30)
    for _ in range(COMPLETIONS_AFTER):
        assert await complete(api) == before_text
    assert peer_in(status_of(a), b_id)["incarnation"] == real_b["incarnation"]
