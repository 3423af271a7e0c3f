"""Fuzz a running `meshnode` process through every stream type it could serve.

Thousands of random and mutated frames go to every stream type, from an admitted
member and from an unadmitted stranger, while a well-behaved in-process node keeps
probing the node under test. Every fuzzed stream must end in a definite answer (a
reply, a clean end, or a reset carrying a mesh error code); the well-behaved peer
must be served throughout; the node's memory must stay bounded.
"""

import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from helpers.mesh_helpers import RawPeer
from helpers.mesh_nodes import fast_config, start_invited_node
from helpers.node_processes import NodeProcess
from helpers.polling import eventually

from meshnode.node import Node
from meshnode.statussocket.client import query_status
from meshnode.transport.base import StreamError, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType
from meshnode.wire.mesh_refusal import refusal_from_reset_code
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES_PER_FUZZER = 1500
CONCURRENCY = 16
# Growth allowed between the RSS after warm-up and after the whole run.
RSS_GROWTH_LIMIT = 48 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def templates(fuzzer, mesh_id: str, proof, victim: bytes) -> dict[int, bytes]:
    if isinstance(fuzzer, Node):
        own = mesh.GossipEntry(record=fuzzer.state.local_record())
    else:
        own = fuzzer.entry(mesh_id)
    gossip = mesh.GossipFrame(gen=1, sender_id=fuzzer.node_id, entries=[own])
    if proof is not None:
        gossip.membership_proof.CopyFrom(proof)
    return {
        StreamType.GOSSIP: gossip.SerializeToString(),
        StreamType.ROUTE_REQUEST: mesh.RouteTableRequest(
            gen=1, requester_id=fuzzer.node_id
        ).SerializeToString(),
        StreamType.PEER_DOWN: mesh.PeerDown(gen=1, peer_id=victim).SerializeToString(),
        StreamType.PEER_LEAVING: mesh.PeerLeaving(gen=1, peer_id=victim).SerializeToString(),
        StreamType.PROBE: mesh.Probe(gen=1, nonce=b"fuzz").SerializeToString(),
        StreamType.SUBPROTOCOL: mesh.MeshSubprotocolOpen(gen=1, name="x", major=1).SerializeToString(),
    }


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif choice < 0.6 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif choice < 0.8:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        else:
            buf += buf[: rng.randint(0, len(buf))]
    return bytes(buf)


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def fuzz_case(rng: random.Random, bodies: dict[int, bytes]) -> tuple[bytes, bool]:
    """Bytes to write on a fresh stream, and whether to reset (instead of finish) afterwards."""
    pick = rng.random()
    if pick < 0.7:
        type_byte = rng.choice(list(bodies))  # the mesh's own stream types
    elif pick < 0.9:
        type_byte = rng.choice([int(t) for t in StreamType])  # every type, handlers of other layers too
    else:
        type_byte = rng.randrange(256)
    template = bodies.get(type_byte, rng.choice(list(bodies.values())))
    kind = rng.random()
    if kind < 0.15:
        payload = rng.randbytes(rng.randint(0, 512))
    elif kind < 0.30:
        payload = frame(rng.randbytes(rng.randint(0, 512)))
    elif kind < 0.75:
        payload = frame(mutate(rng, template))
    elif kind < 0.82:
        payload = frame(template) + frame(mutate(rng, template))  # a second frame where one is expected
    elif kind < 0.88:
        payload = rng.randint(MAX_FRAME_BYTES + 1, 2**32 - 1).to_bytes(4, "little") + rng.randbytes(64)
    elif kind < 0.94:
        payload = (len(template) + rng.randint(1, 100)).to_bytes(4, "little") + template  # truncated
    elif kind < 0.97:
        payload = frame(rng.randbytes(rng.randint(64 * 1024, 512 * 1024)))
    else:
        payload = frame(template)
    first = b"" if rng.random() < 0.01 else bytes([type_byte])
    return first + payload, rng.random() < 0.05


async def run_case(link, data: bytes, reset: bool) -> str:
    stream = await link.open_raw_stream()
    try:
        await stream.write(data)
        if reset:
            stream.reset(0x1)
            return "reset-by-us"
        stream.finish()
        framed = FramedStream(stream, expect_stream_type=False)
        async with asyncio.timeout(10):
            while await framed.recv_frame() is not None:
                pass
        return "answered"
    except StreamReset as exc:
        refusal = refusal_from_reset_code(exc.error_code)
        return refusal.code_name if refusal is not None else f"reset-0x{exc.error_code:x}"
    except TimeoutError:
        return "TIMEOUT"
    except StreamError as exc:
        return f"stream-error:{type(exc).__name__}"


async def fuzz(get_link, bodies, seed: int, outcomes: Counter) -> None:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(link, data, reset):
        async with semaphore:
            outcome = await run_case(link, data, reset)
        outcomes[outcome] += 1
        if outcome == "TIMEOUT":  # keep the evidence for the failure message
            outcomes[f"TIMEOUT on {data[:12].hex()}... ({len(data)} bytes)"] += 1

    tasks = []
    for _ in range(CASES_PER_FUZZER):
        data, reset = fuzz_case(rng, bodies)
        link = await get_link()
        tasks.append(asyncio.create_task(one(link, data, reset)))
        if len(tasks) >= 4 * CONCURRENCY:
            await asyncio.gather(*tasks)
            tasks.clear()
    await asyncio.gather(*tasks)


async def test_fuzzed_frames_never_stop_the_node_from_serving(tmp_path):
    target = NodeProcess(tmp_path, "target")
    target.start(
        "create",
        *("--listen", "127.0.0.1:0"),
        *("--heartbeat-interval", "0.5", "--gossip-timeout", "1", "--probe-timeout", "1"),
    )
    process, data_dir = target.process, target.data_dir
    good: Node | None = None
    member: Node | None = None
    try:
        status = await eventually(target.live_status, 30, "the target to answer status", interval=0.1)
        target_id = target.node_id()
        address = status["node"]["addresses"][0]

        # The well-behaved peer: a real node that joined with an invite.
        invite = target.invite()
        good = await start_invited_node(tmp_path / "good", fast_config(heartbeat_interval=0.5), invite)

        probes = Counter()
        stop_probing = asyncio.Event()

        async def keep_probing():
            while not stop_probing.is_set():
                probes[await good.probe(target_id)] += 1
                await asyncio.sleep(0.2)

        # The fuzzing member is a real node too (it must answer the target's heartbeats
        # and probes, or it would rightly be dropped); garbage goes over its link.
        member = await start_invited_node(tmp_path / "member", fast_config(heartbeat_interval=0.5), invite)
        async with RawPeer() as stranger:
            stranger_link = await stranger.endpoint.dial(address, target_id)

            async def member_link():
                return await member.get_link(target_id)

            async def the_stranger_link():
                return stranger_link

            member_bodies = templates(member, invite.mesh_id, member.state.our_proof(target_id), good.node_id)
            stranger_bodies = templates(stranger, invite.mesh_id, None, good.node_id)

            prober = asyncio.create_task(keep_probing())
            outcomes = Counter()
            # Warm-up, then the baseline for memory.
            await fuzz(member_link, member_bodies, 0, Counter())
            rss_start = rss_bytes(process.pid)
            await asyncio.gather(
                fuzz(member_link, member_bodies, 1, outcomes),
                fuzz(the_stranger_link, stranger_bodies, 2, outcomes),
            )
            await fuzz(member_link, member_bodies, 3, outcomes)
            rss_end = rss_bytes(process.pid)
            stop_probing.set()
            await prober

            assert process.poll() is None, "the node died"
            assert outcomes["TIMEOUT"] == 0, outcomes
            assert outcomes.total() == 3 * CASES_PER_FUZZER
            unexpected = [
                k for k in outcomes if not (k.startswith("MESH_ERROR_") or k in ("answered", "reset-by-us"))
            ]
            assert not unexpected, outcomes
            # Every kind of refusal the fuzzer should provoke, provoked.
            for code in (
                "MALFORMED",
                "NOT_ADMITTED",
                "FRAME_TOO_LARGE",
                "UNKNOWN_STREAM_TYPE",
                "BAD_GENERATION",
            ):
                assert outcomes[f"MESH_ERROR_{code}"] > 0, outcomes
            assert probes[True] >= 5 and probes[False] == 0, probes
            assert not stranger_link.is_closed
            assert rss_end - rss_start < RSS_GROWTH_LIMIT, (rss_start, rss_end)

        status = query_status(data_dir)
        assert good.identity.short_id in {p["short_id"] for p in status["peers"]}
        assert len(status["peers"]) <= 1024
        print(
            json.dumps({"outcomes": outcomes, "rss_start": rss_start, "rss_end": rss_end, "probes": probes})
        )
    finally:
        for node in (good, member):
            if node is not None:
                await node.shutdown()
        target.stop()
