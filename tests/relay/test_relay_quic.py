"""The relay over real QUIC on loopback: registration refusals, forwarding, fairness,
replacement, peer-gone, keepalive, and sealed relayed links (tampering and replaying relays)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from helpers.polling import eventually
from relay_helpers import EchoHandler, Member, new_member, registered_links

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.client import RelayDialer, RelaySession
from meshnode.relaylink.manager import RelayLinks
from meshnode.relaylink.seal import KIND_SEALED
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import RelayRefused, relay
from meshnode.transport.base import LinkClosed
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import DialError, QuicConfig
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh
from relay.core import RelayCore, RelayPolicy
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)


@dataclass
class RelayEnv:
    server: RelayServer
    mesh_key: MeshKey
    dialers: list[RelayDialer]

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.server.relay_id, f"127.0.0.1:{self.server.address[1]}")

    def member(self) -> Member:
        return new_member(self.mesh_key)

    async def session(self, member: Member, quic: QuicConfig | None = None, **kwargs) -> RelaySession:
        dialer = await RelayDialer.open(member.identity, quic, host="127.0.0.1")
        self.dialers.append(dialer)
        return await dialer.register(self.endpoint, mesh_id=member.mesh_id, proof=member.proof, **kwargs)


@contextlib.asynccontextmanager
async def relay_env(
    policy: RelayPolicy | None = None, quic: QuicConfig | None = None
) -> AsyncIterator[RelayEnv]:
    mesh_key = MeshKey.generate()
    server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id}, policy, quic=quic, flush_timeout=0.3)
    await server.start("127.0.0.1", 0)
    env = RelayEnv(server=server, mesh_key=mesh_key, dialers=[])
    try:
        yield env
    finally:
        await server.close(flush_timeout=0.3)
        for dialer in env.dialers:
            dialer.close()
        await asyncio.sleep(0.01)


async def next_kind(session: RelaySession, kind: str, timeout: float = 5.0) -> relay.RelayServerMessage:
    async with asyncio.timeout(timeout):
        while True:
            message = await session.recv()
            assert message is not None, "relay ended the stream"
            if message.WhichOneof("kind") == kind:
                return message


# -- registration over QUIC -------------------------------------------------------------


async def test_registered_members_exchange_frames() -> None:
    async with relay_env() as env:
        a, b = env.member(), env.member()
        sa, sb = await env.session(a), await env.session(b)
        assert sa.limits.keepalive_ms < 30_000
        await sa.send(b.node_id, 9, b"sealed bytes the relay does not read")
        message = await next_kind(sb, "deliver")
        assert (message.deliver.source_id, message.deliver.channel) == (a.node_id, 9)
        assert message.deliver.payload == b"sealed bytes the relay does not read"


async def test_registering_without_a_membership_credential_is_refused() -> None:
    async with relay_env() as env:
        stranger = env.member()
        dialer = await RelayDialer.open(stranger.identity, host="127.0.0.1")
        env.dialers.append(dialer)
        with pytest.raises(RelayRefused) as refused:
            await dialer.register(env.endpoint, mesh_id=env.mesh_key.mesh_id, proof=None)
        assert refused.value.code == p.NOT_A_MEMBER
        assert refused.value.membership_error == mesh.MESH_ERROR_NO_CREDENTIAL
        # Nothing is delivered to it: a member sending to it is told it is unknown.
        member = env.member()
        session = await env.session(member)
        await session.send(stranger.node_id, 2, b"anyone there?", send_id=41)
        message = await next_kind(session, "send_refused")
        assert message.send_refused.refusal.code == p.DESTINATION_UNKNOWN
        assert message.send_refused.send_id == 41


async def test_registering_an_id_without_its_private_key_is_refused() -> None:
    """A thief holding a member's certificate cannot register as that member."""
    async with relay_env() as env:
        victim, thief = env.member(), env.member()
        dialer = await RelayDialer.open(thief.identity, host="127.0.0.1")
        env.dialers.append(dialer)
        link = await dialer.endpoint.dial(env.endpoint.address, env.server.relay_id)
        stream = await dialer.waiter.future_for(link)
        framed = FramedStream(stream, expect_stream_type=False, max_frame_bytes=p.MAX_RELAY_FRAME_BYTES)
        challenge = p.decode_server_message(await framed.recv_frame(5)).challenge.challenge
        message = p.registration_message(env.server.relay_id, challenge, victim.node_id, victim.mesh_id)
        register = relay.RelayRegister(
            node_id=victim.node_id, mesh_id=victim.mesh_id, signature=thief.identity.sign(message)
        )
        register.membership_proof.CopyFrom(victim.proof)
        await framed.send_frame(relay.RelayClientMessage(register=register).SerializeToString())
        reply = p.decode_server_message(await framed.recv_frame(5))
        assert reply.refused.code == p.IDENTITY_MISMATCH
        assert env.server.core.stats.refused_registrations == 1


async def test_client_refuses_a_relay_that_is_not_the_pinned_one() -> None:
    async with relay_env() as env:
        member = env.member()
        dialer = await RelayDialer.open(member.identity, host="127.0.0.1")
        env.dialers.append(dialer)
        impostor_pin = Endpoint(NodeIdentity.generate().node_id, env.endpoint.address)
        with pytest.raises(DialError, match="not the expected node"):
            await dialer.register(impostor_pin, mesh_id=member.mesh_id, proof=member.proof, connect_timeout=2)


# -- forwarding behaviour ---------------------------------------------------------------


async def test_flood_from_one_sender_does_not_starve_another_over_quic() -> None:
    # Small windows so only a few frames sit in QUIC buffers; the rest wait in the relay's fair queue.
    relay_quic = QuicConfig(max_stream_backlog=128 * 1024, max_connection_backlog=256 * 1024)
    async with relay_env(quic=relay_quic) as env:
        flooder, quiet, b = env.member(), env.member(), env.member()
        receiver_quic = QuicConfig(stream_window=128 * 1024, connection_window=256 * 1024)
        sf, sq = await env.session(flooder), await env.session(quiet)
        sb = await env.session(b, quic=receiver_quic)
        flood = 60
        for i in range(flood):
            await sf.send(b.node_id, 2, i.to_bytes(4, "little") + b"f" * (64 * 1024))
        # Wait until the flood is queued at the relay, then the quiet sender speaks.
        await eventually(lambda: env.server.core.queued_bytes_for(b.node_id) >= 30 * 64 * 1024, 10)
        for i in range(3):
            await sq.send(b.node_id, 2, b"quiet %d" % i)
        order = []
        async with asyncio.timeout(30):
            while len(order) < flood + 3:
                message = await next_kind(sb, "deliver")
                order.append(bytes(message.deliver.source_id))
        positions = [i for i, source in enumerate(order) if source == quiet.node_id]
        assert len(positions) == 3
        # FIFO would put them after the whole flood (positions >= 60).
        assert positions[-1] < 20, positions


async def test_overflowing_a_destination_queue_is_refused_to_the_sender() -> None:
    policy = RelayPolicy(
        max_payload_bytes=64 * 1024,
        source_queue_bytes=256 * 1024,
        destination_queue_bytes=256 * 1024,
        total_queue_bytes=256 * 1024,
    )
    relay_quic = QuicConfig(max_stream_backlog=64 * 1024, max_connection_backlog=64 * 1024)
    async with relay_env(policy, quic=relay_quic) as env:
        a, b = env.member(), env.member()
        sa = await env.session(a)
        await env.session(b, quic=QuicConfig(stream_window=64 * 1024, connection_window=64 * 1024))
        for i in range(20):  # b never reads
            await sa.send(b.node_id, 2, b"x" * (60 * 1024), send_id=i)
        message = await next_kind(sa, "send_refused")
        assert message.send_refused.refusal.code == p.QUEUE_FULL
        assert env.server.core.queued_bytes_for(b.node_id) <= 256 * 1024
        # The relay still serves everyone else.
        c = env.member()
        sc = await env.session(c)
        await sa.send(c.node_id, 2, b"still forwarding")
        assert (await next_kind(sc, "deliver")).deliver.payload == b"still forwarding"


async def test_a_client_over_its_rate_limit_is_slowed_not_dropped() -> None:
    policy = RelayPolicy(rate_bytes_per_s=1024 * 1024, burst_bytes=64 * 1024)
    async with relay_env(policy) as env:
        a, b = env.member(), env.member()
        sa, sb = await env.session(a), await env.session(b)
        frame = p.encode_send(b.node_id, 2, b"z" * 32 * 1024)
        for _ in range(32):  # 1 MiB at once, ignoring the announced limits (no client-side pacing)
            await sa.framed.send_frame(frame)
        got = 0
        while got < 32:
            got += (await next_kind(sb, "deliver", timeout=10)).WhichOneof("kind") == "deliver"
        assert env.server.read_pauses > 0  # the relay stopped reading from A until its bucket refilled
        assert env.server.core.stats.refused_frames == {}  # ...and refused nothing
        assert not sa.is_closed


async def test_second_registration_replaces_the_first() -> None:
    async with relay_env() as env:
        a, b = env.member(), env.member()
        sa = await env.session(a)
        old = await env.session(b)
        new = await env.session(b)
        refused = await next_kind(old, "refused")
        assert refused.refused.code == p.REPLACED
        await sa.send(b.node_id, 2, b"to the newest")
        assert (await next_kind(new, "deliver")).deliver.payload == b"to the newest"


async def test_a_replaced_client_that_stopped_reading_is_still_closed() -> None:
    relay_quic = QuicConfig(max_stream_backlog=64 * 1024, max_connection_backlog=64 * 1024)
    async with relay_env(quic=relay_quic) as env:
        a, b = env.member(), env.member()
        sa = await env.session(a)
        stuck = await env.session(b, quic=QuicConfig(stream_window=64 * 1024, connection_window=64 * 1024))
        for _ in range(10):  # more than its windows: the relay's writer to it blocks
            await sa.send(b.node_id, 2, b"x" * 60 * 1024)
        await asyncio.sleep(0.2)
        await env.session(b)  # newest wins; the old connection never reads its REPLACED refusal
        await asyncio.wait_for(stuck.link.wait_closed(), 5)
        assert "not reading" in stuck.link.close_reason


async def test_senders_are_told_when_the_destination_goes_away() -> None:
    async with relay_env() as env:
        a, b = env.member(), env.member()
        sa, sb = await env.session(a), await env.session(b)
        await sa.send(b.node_id, 2, b"hello")
        await next_kind(sb, "deliver")
        sb.close("leaving")
        gone = await next_kind(sa, "peer_gone")
        assert gone.peer_gone.peer_id == b.node_id


async def test_keepalive_keeps_an_idle_client_registered() -> None:
    # The client never pings and times out idle connections after 1.5 s; only the relay's pings keep it.
    relay_quic = QuicConfig(idle_timeout=1.5)
    async with relay_env(RelayPolicy(keepalive_s=0.3), quic=relay_quic) as env:
        a, b = env.member(), env.member()
        quiet_client = QuicConfig(idle_timeout=1.5, keepalive_interval=1000.0)
        sa, sb = await env.session(a, quic=quiet_client), await env.session(b)
        await asyncio.sleep(3.0)
        assert not sa.is_closed
        await sb.send(a.node_id, 2, b"still here")
        assert (await next_kind(sa, "deliver")).deliver.payload == b"still here"


# -- sealed relayed links ---------------------------------------------------------------


async def relay_links(env: RelayEnv, member: Member, handler: EchoHandler | None = None) -> RelayLinks:
    return await registered_links(member, env.endpoint, handler or EchoHandler())


async def test_relayed_link_carries_framed_streams_both_ways() -> None:
    async with relay_env() as env:
        a, b = env.member(), env.member()
        la, handler_b = await relay_links(env, a), EchoHandler()
        lb = await relay_links(env, b, handler_b)
        try:
            link = await la.open_link(b.node_id)
            assert link.peer_id == b.node_id and link.initiated_locally
            stream = await link.open_stream(StreamType.PROBE)
            big = bytes(range(256)) * (6 * 1024 + 7)  # 1.5 MiB: more than a stream window
            for frame in (b"small", big, b""):
                await stream.send_frame(frame)
                assert await stream.recv_frame(20) == frame
            stream.finish()
            assert await stream.recv_frame(5) is None
            (accepted,) = handler_b.links
            assert accepted.peer_id == a.node_id and not accepted.initiated_locally
            # Concurrent streams on one link.
            streams = [await link.open_stream(StreamType.PROBE) for _ in range(5)]
            for i, s in enumerate(streams):
                await s.send_frame(b"stream %d" % i)
            assert [await s.recv_frame(5) for s in streams] == [b"stream %d" % i for i in range(5)]
            assert la.frames_dropped == lb.frames_dropped == 0
        finally:
            await la.close()
            await lb.close()


class TamperingCore(RelayCore):
    """A relay that flips one bit in, or delivers twice, the next sealed stream payload it forwards."""

    mode = "off"
    replay_pending: tuple[int, bytes] | None = None

    def next_frame(self, conn_id: int) -> bytes | None:
        if self.replay_pending is not None and self.replay_pending[0] == conn_id:
            body, self.replay_pending = self.replay_pending[1], None
            return body
        body = super().next_frame(conn_id)
        if body is None or self.mode == "off":
            return body
        message = p.decode_server_message(body)
        if message.WhichOneof("kind") != "deliver" or message.deliver.payload[:1] != bytes((KIND_SEALED,)):
            return body
        if message.deliver.channel == 0:
            return body  # leave link control alone; tamper with stream data
        mode, self.mode = self.mode, "off"
        if mode == "flip":
            payload = bytearray(message.deliver.payload)
            payload[-5] ^= 0x10
            message.deliver.payload = bytes(payload)
            return message.SerializeToString()
        self.replay_pending = (conn_id, body)  # "replay": the same frame goes out again right after
        return body


@contextlib.asynccontextmanager
async def echo_through_a_tampering_relay() -> AsyncIterator[tuple[TamperingCore, FramedStream, RelayLinks]]:
    """A warmed-up echo stream from member A to member B through a relay that tampers when told to,
    that relay's core, and B's relay links (which count the payloads they drop)."""
    async with relay_env() as env:
        env.server.core.__class__ = TamperingCore  # fault injection: the running relay's core tampers
        core = env.server.core
        assert isinstance(core, TamperingCore)
        a, b = env.member(), env.member()
        la, lb = await relay_links(env, a), await relay_links(env, b)
        try:
            link = await la.open_link(b.node_id)
            stream = await link.open_stream(StreamType.PROBE)
            await stream.send_frame(b"warm-up")
            assert await stream.recv_frame(5) == b"warm-up"
            yield core, stream, lb
        finally:
            await la.close()
            await lb.close()


async def test_frame_altered_by_a_tampering_relay_is_rejected_by_the_receiver() -> None:
    async with echo_through_a_tampering_relay() as (relay_core, stream, receiver):
        before = receiver.frames_dropped
        relay_core.mode = "flip"
        await stream.send_frame(b"the relay flips a bit in this frame")
        await stream.send_frame(b"an intact frame after it")
        # The receiver drops the altered frame (counted) and never serves altered bytes:
        # the hole it leaves is detected and ends the relayed link instead of corrupting it.
        with pytest.raises(LinkClosed, match="frame lost"):
            reply = await stream.recv_frame(5)
            raise AssertionError(f"a frame was served after tampering: {reply!r}")
        assert receiver.frames_dropped == before + 1


async def test_frame_replayed_by_the_relay_is_rejected() -> None:
    async with echo_through_a_tampering_relay() as (relay_core, stream, receiver):
        before = receiver.frames_dropped
        relay_core.mode = "replay"
        await stream.send_frame(b"once")
        assert await stream.recv_frame(5) == b"once"
        assert relay_core.mode == "off" and relay_core.replay_pending is None  # it did replay
        assert receiver.frames_dropped == before + 1  # the second copy was refused by the replay window
        await stream.send_frame(b"next")
        # The echo stream is intact: nothing was served twice.
        assert await stream.recv_frame(5) == b"next"
        stream.finish()
        assert await stream.recv_frame(5) is None


async def test_relay_restart_ends_links_and_nodes_re_register() -> None:
    mesh_key = MeshKey.generate()
    identity = NodeIdentity.generate()
    server = RelayServer(identity, {mesh_key.mesh_id})
    await server.start("127.0.0.1", 0)
    port = server.address[1]
    env = RelayEnv(server=server, mesh_key=mesh_key, dialers=[])
    a, b = env.member(), env.member()
    la, lb = await relay_links(env, a), await relay_links(env, b)
    try:
        link = await la.open_link(b.node_id)
        await server.close()
        await asyncio.wait_for(link.wait_closed(), 5)
        assert "relay" in link.close_reason
        server = RelayServer(identity, {mesh_key.mesh_id})
        await server.start("127.0.0.1", port)
        client_a = la.client(identity.node_id)
        await eventually(lambda: client_a.registered and lb.client(identity.node_id).registered, 15)
        assert client_a.registrations == 2
        link = await la.open_link(b.node_id)
        stream = await link.open_stream(StreamType.PROBE)
        await stream.send_frame(b"after restart")
        assert await stream.recv_frame(5) == b"after restart"
    finally:
        await la.close()
        await lb.close()
        await server.close()
