"""Helpers of the relay tests: members, registration frames, echoing peers and their relay links."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    certificate_proof,
    create_invite,
    issue_certificate,
    make_invite_proof,
)
from meshnode.relaylink.manager import RelayLinkConfig, RelayLinks
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import relay
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.framed import FramedStream
from relay.core import RelayCore, RelayPolicy


@dataclass
class Member:
    identity: NodeIdentity
    proof: membership.MembershipProof | None
    mesh_id: str

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id


def new_member(mesh_key: MeshKey) -> Member:
    identity = NodeIdentity.generate()
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time()
    )
    return Member(identity=identity, proof=certificate_proof(certificate), mesh_id=mesh_key.mesh_id)


def invited_joiner(
    mesh_key: MeshKey, *, verifier_id: bytes, ttl_s: float = 3600, now: float | None = None
) -> Member:
    """A node holding only an invite, proving it to ``verifier_id``."""
    issued = time.time() if now is None else now
    issuer = NodeIdentity.generate()
    invite = create_invite(
        mesh_key,
        issuer_id=issuer.node_id,
        bootstrap=[Endpoint(id=issuer.node_id, address="198.18.0.1:4433")],
        relays=[Endpoint(id=verifier_id, address="198.18.0.1:4434")],
        ttl_s=ttl_s,
        unix_now=issued,
    )
    identity = NodeIdentity.generate()
    proof = make_invite_proof(invite, joiner_id=identity.node_id, verifier_id=verifier_id)
    return Member(identity=identity, proof=proof, mesh_id=mesh_key.mesh_id)


def register_frame(
    member: Member,
    *,
    relay_id: bytes,
    challenge: bytes,
    signer: NodeIdentity | None = None,
    node_id: bytes | None = None,
    mesh_id: str | None = None,
    proof: membership.MembershipProof | bool | None = True,
) -> bytes:
    """A RelayRegister frame; the keyword arguments forge parts of it."""
    claimed = member.node_id if node_id is None else node_id
    mesh = member.mesh_id if mesh_id is None else mesh_id
    signature = (signer or member.identity).sign(p.registration_message(relay_id, challenge, claimed, mesh))
    register = relay.RelayRegister(node_id=claimed, mesh_id=mesh, signature=signature)
    chosen = member.proof if proof is True else proof
    if chosen:
        register.membership_proof.CopyFrom(chosen)
    return relay.RelayClientMessage(register=register).SerializeToString()


class EchoHandler:
    """LinkHandler that echoes every frame on every accepted stream."""

    def __init__(self) -> None:
        self.links: list[PeerLink] = []
        self.closed: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def link_established(self, link: PeerLink) -> None:
        self.links.append(link)

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(stream))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        self.closed.append(reason)

    async def _serve(self, stream: MeshStream) -> None:
        framed = FramedStream(stream, expect_stream_type=True)
        with contextlib.suppress(Exception):
            await framed.read_stream_type(5)
            while (frame := await framed.recv_frame()) is not None:
                await framed.send_frame(frame)
            framed.finish()


async def registered_links(
    member: Member,
    relay: Endpoint,
    handler: EchoHandler,
    *,
    handshake_timeout: float = 3.0,
    within: float = 5.0,
) -> RelayLinks:
    """``member``'s relay links through ``relay``, once registered there (waiting at most ``within`` s)."""
    links = RelayLinks(
        member.identity,
        handler,
        mesh_id=member.mesh_id,
        proof_for=lambda _relay_id: member.proof,
        settings=RelayLinkConfig(handshake_timeout=handshake_timeout),
        local_host="127.0.0.1",
    )
    await links.add_relays([relay])
    await links.wait_registered(within)
    return links


_SECOND = 1_000_000_000


class RelayDriver:
    """Drives a RelayCore like the QUIC edge does, with a controllable clock."""

    def __init__(self, policy: RelayPolicy | None = None) -> None:
        self.relay_id = NodeIdentity.generate().node_id
        self.mesh_key = MeshKey.generate()
        self.core = RelayCore(self.relay_id, {self.mesh_key.mesh_id}, policy)
        # Monotonic nanoseconds: the relay's timers and rate buckets run on this, never on unix time.
        self.now = 1000 * _SECOND
        self._ids = itertools.count(1)

    def connect(self, tls_id: bytes) -> tuple[int, bytes]:
        conn = next(self._ids)
        self.core.connection_made(conn, tls_id, self.now)
        (message,) = self.drain(conn)
        assert message.WhichOneof("kind") == "challenge"
        assert message.challenge.relay_id == self.relay_id
        return conn, message.challenge.challenge

    def feed(self, conn: int, body: bytes) -> None:
        self.core.receive_frame(conn, body, self.now, unix_now=time.time())

    def register(self, member: Member) -> int:
        conn, challenge = self.connect(member.node_id)
        self.feed(conn, register_frame(member, relay_id=self.relay_id, challenge=challenge))
        (message,) = self.drain(conn)
        assert message.WhichOneof("kind") == "registered", message
        assert message.registered.node_id == member.node_id
        return conn

    def member(self) -> Member:
        return new_member(self.mesh_key)

    def send(
        self, conn: int, destination: bytes, payload: bytes, *, channel: int = 2, send_id: int = 0
    ) -> None:
        self.feed(conn, p.encode_send(destination, channel, payload, send_id))

    def drain(self, conn: int) -> list[relay.RelayServerMessage]:
        out = []
        while (body := self.core.next_frame(conn)) is not None:
            out.append(p.decode_server_message(body))
        return out

    def refusal_of(self, conn: int) -> relay.RelayRefusal:
        messages = self.drain(conn)
        assert messages and messages[-1].WhichOneof("kind") == "refused", messages
        assert self.core.is_closing(conn)
        return messages[-1].refused
