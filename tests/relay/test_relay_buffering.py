"""What a connection that has not registered can cost the relay, and the relay's read limits.

The state machine (no I/O): unregistered connections are capped in total and
per source address, and may send only a registration-sized frame. Over QUIC
(in-process relay): the same refusals reach the client with their exact codes,
and a registered client that stalls mid-frame is refused and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import pytest
from relay_helpers import Member, new_member, register_frame

from meshnode.app.cli import build_parser
from meshnode.commandline.config import parse_args_with_config
from meshnode.commandline.read_limit_options import parse_bytes
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.client import RelayDialer
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import relay
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicConfig
from meshnode.wire.errors import (
    BufferLimitExceeded,
    FrameStalled,
    FrameTooLarge,
    FramingError,
    TruncatedFrame,
)
from meshnode.wire.framing import MAX_FRAME_BYTES
from relay.core import RelayCore, RelayPolicy, source_group
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)

# Monotonic nanoseconds, the relay core's clock.
NOW = 1000 * 1_000_000_000


class Core:
    def __init__(self, policy: RelayPolicy) -> None:
        self.relay_id = NodeIdentity.generate().node_id
        self.mesh_key = MeshKey.generate()
        self.core = RelayCore(self.relay_id, {self.mesh_key.mesh_id}, policy)
        self._ids = itertools.count(1)
        self.challenges: dict[int, bytes] = {}

    def connect(self, source: str, tls_id: bytes | None = None) -> int:
        conn = next(self._ids)
        self.core.connection_made(conn, tls_id or NodeIdentity.generate().node_id, NOW, source=source)
        first = p.decode_server_message(self.core.next_frame(conn) or b"")
        if first.WhichOneof("kind") == "challenge":
            self.challenges[conn] = first.challenge.challenge
        else:
            self.last_refusal = first.refused
        return conn

    def register(self, conn: int, member: Member) -> None:
        body = register_frame(member, relay_id=self.relay_id, challenge=self.challenges[conn])
        self.core.receive_frame(conn, body, NOW, unix_now=time.time())
        assert p.decode_server_message(self.core.next_frame(conn) or b"").WhichOneof("kind") == "registered"

    def refused_code(self, conn: int) -> int:
        assert self.core.is_closing(conn)
        return self.last_refusal.code


def test_unregistered_connections_are_capped_per_source_and_registering_frees_the_slot() -> None:
    r = Core(RelayPolicy(max_unregistered=8, max_unregistered_per_source=2))
    member = new_member(r.mesh_key)
    first = r.connect("198.18.0.5", tls_id=member.node_id)
    r.connect("198.18.0.5")
    third = r.connect("198.18.0.5")
    assert r.refused_code(third) == p.OVERLOADED
    assert "from this address" in r.last_refusal.detail
    assert not r.core.is_closing(r.connect("198.18.0.6"))  # another address has its own quota
    r.register(first, member)
    assert r.core.unregistered_from("198.18.0.5") == 1
    assert not r.core.is_closing(r.connect("198.18.0.5"))
    assert r.core.stats.connections_refused == {"RELAY_ERROR_OVERLOADED": 1}


def test_unregistered_connections_are_capped_in_total_and_a_lost_one_frees_its_slot() -> None:
    r = Core(RelayPolicy(max_unregistered=2, max_unregistered_per_source=2))
    first = r.connect("198.18.0.1")
    r.connect("198.18.0.2")
    over = r.connect("198.18.0.3")
    assert r.refused_code(over) == p.OVERLOADED
    assert "waiting to register" in r.last_refusal.detail
    r.core.connection_lost(over)  # a refused one never counted
    r.core.connection_lost(first)
    assert r.core.stats.unregistered == 1
    assert not r.core.is_closing(r.connect("198.18.0.3"))


def test_a_relay_shutting_down_refuses_new_connections() -> None:
    r = Core(RelayPolicy())
    r.core.shutdown()
    assert r.refused_code(r.connect("198.18.0.1")) == p.SHUTTING_DOWN
    assert r.core.stats.unregistered == 0


def test_one_ipv6_slash_64_counts_as_one_source() -> None:
    assert source_group("2001:db8:1:2::1") == source_group("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert source_group("2001:db8:1:3::1") != source_group("2001:db8:1:2::1")
    assert source_group("::ffff:198.18.0.7") == source_group("198.18.0.7") == "198.18.0.7"
    r = Core(RelayPolicy(max_unregistered=8, max_unregistered_per_source=1))
    r.connect("2001:db8:1:2::1")
    assert r.refused_code(r.connect("2001:db8:1:2::2")) == p.OVERLOADED


def test_before_registration_only_a_registration_sized_frame_is_accepted() -> None:
    r = Core(RelayPolicy())
    member = new_member(r.mesh_key)
    conn = r.connect("198.18.0.1", tls_id=member.node_id)
    assert r.core.max_frame_bytes(conn) == p.MAX_REGISTRATION_FRAME_BYTES == 16 * 1024
    # Any registration fits: the largest proof, an invite body, comes from a token of at most 16 KiB.
    assert len(register_frame(member, relay_id=r.relay_id, challenge=r.challenges[conn])) < 1024
    r.register(conn, member)
    assert r.core.max_frame_bytes(conn) == p.MAX_RELAY_FRAME_BYTES

    big = r.connect("198.18.0.1")
    r.core.receive_frame(big, b"\x00" * (p.MAX_REGISTRATION_FRAME_BYTES + 1), NOW, unix_now=time.time())
    refusal = p.decode_server_message(r.core.next_frame(big) or b"").refused
    assert refusal.code == p.PAYLOAD_TOO_LARGE
    assert "before registration" in refusal.detail


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (FrameTooLarge(MAX_FRAME_BYTES, 16 * 1024), p.PAYLOAD_TOO_LARGE),
        (BufferLimitExceeded("process", 10, 5, 12), p.OVERLOADED),
        (FrameStalled(3, 30.0), p.FRAME_STALLED),
        (TruncatedFrame(3, 10), p.MALFORMED),
    ],
)
def test_each_framing_failure_has_its_relay_code(error: FramingError, code: int) -> None:
    assert p.refusal_for_framing_error(error, registered=False).code == code


def test_unregistered_caps_must_be_consistent() -> None:
    with pytest.raises(ValueError):
        RelayPolicy(max_unregistered=4, max_unregistered_per_source=5)


def test_the_relay_command_takes_the_caps_from_its_options_and_environment() -> None:
    environ = {"MESHNODE_RELAY_FRAME_BUFFER_TOTAL": "128MiB", "MESHNODE_RELAY_MAX_UNREGISTERED": "64"}
    args = parse_args_with_config(
        build_parser(),
        ["relay", "--mesh", "a" * 26, "--max-unregistered-per-source", "4", "--frame-stall-timeout", "5"],
        environ,
    )
    assert (args.frame_buffer_total, args.max_unregistered, args.max_unregistered_per_source) == (
        128 * 1024 * 1024,
        64,
        4,
    )
    assert (args.frame_buffer_per_connection, args.frame_stall_timeout) == (64 * 1024 * 1024, 5.0)
    assert [parse_bytes(t) for t in ("1048576", "16KiB", "64M", "1gib")] == [2**20, 2**14, 2**26, 2**30]
    with pytest.raises(SystemExit):
        parse_args_with_config(build_parser(), ["relay", "--frame-buffer-total", "lots"], {})


# -- over QUIC ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def relay_server(policy: RelayPolicy, quic: QuicConfig | None = None) -> AsyncIterator[RelayServer]:
    server = RelayServer(NodeIdentity.generate(), {"test-mesh"}, policy, quic=quic, flush_timeout=0.3)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close(flush_timeout=0.3)


@contextlib.asynccontextmanager
async def raw_client(
    server: RelayServer, identity: NodeIdentity | None = None
) -> AsyncIterator[FramedStream]:
    """A connection that got its challenge (read), and nothing else yet."""
    dialer = await RelayDialer.open(identity or NodeIdentity.generate(), host="127.0.0.1")
    try:
        link = await dialer.endpoint.dial(f"127.0.0.1:{server.address[1]}", server.relay_id)
        stream = await asyncio.wait_for(dialer.waiter.future_for(link), 5)
        framed = FramedStream(stream, expect_stream_type=False, max_frame_bytes=p.MAX_RELAY_FRAME_BYTES)
        yield framed
    finally:
        dialer.close()


async def refusal(framed: FramedStream) -> relay.RelayRefusal:
    async with asyncio.timeout(10):
        while (body := await framed.recv_frame()) is not None:
            message = p.decode_server_message(body)
            if message.WhichOneof("kind") == "refused":
                return message.refused
    raise AssertionError("the relay ended the stream without a refusal")


async def test_over_quic_a_prefix_over_a_registration_is_refused_and_the_source_cap_holds() -> None:
    async with (
        relay_server(RelayPolicy(max_unregistered=16, max_unregistered_per_source=2)) as server,
        raw_client(server) as first,
        raw_client(server) as second,
        raw_client(server) as third,
    ):
        assert p.decode_server_message(await first.recv_frame(5)).WhichOneof("kind") == "challenge"
        assert p.decode_server_message(await second.recv_frame(5)).WhichOneof("kind") == "challenge"
        over = await refusal(third)
        assert (over.code, over.detail) == (
            p.OVERLOADED,
            "too many unregistered connections from this address",
        )
        await first.stream.write(MAX_FRAME_BYTES.to_bytes(4, "little") + b"hi")
        too_large = await refusal(first)
        assert too_large.code == p.PAYLOAD_TOO_LARGE
        assert server.core.stats.connections_refused == {
            "RELAY_ERROR_OVERLOADED": 1,
            "RELAY_ERROR_PAYLOAD_TOO_LARGE": 1,
        }


async def test_over_quic_a_registered_client_stalled_mid_frame_is_refused_and_closed() -> None:
    mesh_key = MeshKey.generate()
    member = new_member(mesh_key)
    server = RelayServer(
        NodeIdentity.generate(),
        {mesh_key.mesh_id},
        quic=QuicConfig(frame_stall_timeout=0.2),
        flush_timeout=0.3,
    )
    await server.start("127.0.0.1", 0)
    dialer = await RelayDialer.open(member.identity, host="127.0.0.1")
    try:
        endpoint = Endpoint(server.relay_id, f"127.0.0.1:{server.address[1]}")
        session = await dialer.register(endpoint, mesh_id=member.mesh_id, proof=member.proof)
        # A maximal relay frame is fine once registered; this one stops after 1 KiB.
        await session.framed.stream.write((4 * 1024 * 1024).to_bytes(4, "little") + b"s" * 1024)
        assert (await refusal(session.framed)).code == p.FRAME_STALLED
        await asyncio.wait_for(session.link.wait_closed(), 5)
        assert server.core.stats.connections_refused == {"RELAY_ERROR_FRAME_STALLED": 1}
    finally:
        dialer.close()
        await server.close(flush_timeout=0.3)
