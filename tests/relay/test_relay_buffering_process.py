"""Strangers cannot make a running relay reserve memory by announcing frames.

The relay is a real ``meshnode relay`` process; two members hold a sealed
relayed session through it (in this process) while 100 connections from fresh
self-signed identities, none of them a member, each answer the relay's
challenge with a length prefix announcing an 8 MiB frame and 2 bytes. Before
frame buffers grew with the bytes that arrive and before unregistered clients
were held to a registration-sized frame, each such prefix made the relay
allocate (and zero-fill) 8 MiB until its registration timeout: measured on a
2-core machine, 100 connections took its VmRSS from 77 to 886 MiB (+809 MiB).
Now each is refused with ``RELAY_ERROR_PAYLOAD_TOO_LARGE`` on the prefix
(78 -> 86 MiB measured: QUIC connection state) and the members' session keeps
working.

The relay runs with the per-source cap on unregistered connections lifted, so
that every attacking connection (all from 127.0.0.1) reaches the frame check;
``test_relay_buffering.py`` shows the cap itself.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from helpers.relay_process import start_relay_process
from helpers.rss import MiB, PeakRss
from relay_helpers import EchoHandler, new_member, registered_links

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.client import RelayDialer
from meshnode.relaylink.manager import RelayLinks
from meshnode.relaywire import protocol as p
from meshnode.transport.base import LinkClosed, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ATTACKERS = 100
RSS_GROWTH_LIMIT = 64 * MiB


async def stranger_announces_a_big_frame(relay_endpoint: Endpoint, dialing: asyncio.Semaphore) -> str:
    """Connect as a fresh identity, answer the challenge with an 8 MiB prefix and 2 bytes.

    Returns the name of the code the relay refused the connection with.
    """
    dialer = await RelayDialer.open(NodeIdentity.generate(), host="127.0.0.1")
    try:
        async with dialing:
            link = await dialer.endpoint.dial(relay_endpoint.address, relay_endpoint.id, timeout=20)
            stream = await asyncio.wait_for(dialer.waiter.future_for(link), 20)
        framed = FramedStream(stream, expect_stream_type=False, max_frame_bytes=p.MAX_RELAY_FRAME_BYTES)
        challenge = p.decode_server_message(await framed.recv_frame(20))
        assert challenge.WhichOneof("kind") == "challenge"
        await stream.write(MAX_FRAME_BYTES.to_bytes(4, "little") + b"hi")
        try:
            async with asyncio.timeout(30):
                while (body := await framed.recv_frame()) is not None:
                    message = p.decode_server_message(body)
                    if message.WhichOneof("kind") == "refused":
                        return p.relay_code_name(message.refused.code)
        except LinkClosed as exc:
            return f"closed: {exc.reason}"
        except StreamError as exc:
            return f"stream error: {exc}"
        return "ended"
    finally:
        dialer.close()


async def test_announced_frames_from_strangers_do_not_reserve_relay_memory(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    process, relay_endpoint = await start_relay_process(
        tmp_path / "relay", mesh_key.mesh_id, "--max-unregistered-per-source", str(2 * ATTACKERS)
    )
    links: list[RelayLinks] = []
    try:
        a, b = new_member(mesh_key), new_member(mesh_key)
        links = [
            await registered_links(m, relay_endpoint, EchoHandler(), handshake_timeout=5.0, within=10)
            for m in (a, b)
        ]
        link = await links[0].open_link(b.node_id, timeout=10)
        session = await link.open_stream(StreamType.PROBE)
        await session.send_frame(b"warm-up")
        assert await session.recv_frame(10) == b"warm-up"

        echoed = 0
        attack_over = asyncio.Event()

        async def keep_talking() -> None:
            # Any failure (a wrong echo, 20 s without one) fails the test.
            nonlocal echoed
            while not attack_over.is_set() or echoed < 3:
                payload = b"round %d" % echoed
                await session.send_frame(payload)
                assert await session.recv_frame(20) == payload
                echoed += 1
                await asyncio.sleep(0.05)

        await asyncio.sleep(0.5)
        async with PeakRss(process.pid) as rss:
            talker = asyncio.create_task(keep_talking())
            dialing = asyncio.Semaphore(16)  # handshakes on a 2-core machine
            outcomes = Counter(
                await asyncio.gather(
                    *(stranger_announces_a_big_frame(relay_endpoint, dialing) for _ in range(ATTACKERS))
                )
            )
            attack_over.set()
            await talker
        print(
            json.dumps(
                {"attackers": ATTACKERS, "rss": rss.describe(), "outcomes": outcomes, "echoed": echoed}
            )
        )

        assert process.poll() is None, "the relay died"
        assert rss.growth < RSS_GROWTH_LIMIT, rss.describe()
        assert outcomes == {"RELAY_ERROR_PAYLOAD_TOO_LARGE": ATTACKERS}, outcomes
        await session.send_frame(b"after the attack")
        assert await session.recv_frame(10) == b"after the attack"
    finally:
        for relay_links in links:
            await relay_links.close()
        process.terminate()
        process.wait(10)
