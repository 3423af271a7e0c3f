"""Which peers are gone: a suspected peer is probed before it is dropped, and peers tell each
other who went down and who leaves.

The rules are pure (:func:`~meshnode.mesh.rules.resolve_peer_down`,
:func:`~meshnode.mesh.rules.resolve_peer_leaving`); whether a peer still answers is
:class:`~meshnode.node.reachability.Reachability`'s. :class:`Liveness` is their asyncio edge:

* a peer is suspected when the heartbeat finds it stale or silent, or when another peer
  reports it down (PEER_DOWN); one probe at a time per peer decides. A peer that answers
  nothing is dropped and its link closed; when we found it ourselves, every other peer is
  told (a PEER_DOWN, which makes each probe it in turn rather than believe us);
* a peer that leaves says so (PEER_LEAVING, :meth:`Liveness.send_leaving` on our side) and is
  dropped at once;
* a PROBE is echoed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshnode.identity import short_id
from meshnode.mesh.message_reader import read_message
from meshnode.mesh.rules import (
    PeerDownAction,
    PeerLeavingAction,
    resolve_peer_down,
    resolve_peer_leaving,
)
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import validate_peer_down, validate_peer_leaving, validate_probe
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.peer_connections import PeerConnections
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.node.reachability import Reachability
from meshnode.transport.base import PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION, StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


class Liveness:
    def __init__(
        self,
        state: MeshState,
        connections: PeerConnections,
        reachability: Reachability,
        background: BackgroundTasks,
        *,
        gossip_timeout: float,
        probe_timeout: float,
        leave_timeout: float,
    ) -> None:
        self._state = state
        self._connections = connections
        self._reachability = reachability
        self._background = background
        self._gossip_timeout = gossip_timeout
        self._probe_timeout = probe_timeout
        self._leave_timeout = leave_timeout
        # Peers a probe is deciding on now (one at a time each).
        self._probing: set[bytes] = set()

    def suspect(self, peer_id: bytes, *, reporter: bytes | None) -> None:
        """Probe ``peer_id`` (a peer in the table, not probed already) and drop it if it answers
        nothing; ``reporter``: the peer that reported it down (``None``: we found it)."""
        if peer_id in self._probing or peer_id not in self._state.table:
            return
        self._probing.add(peer_id)
        self._background.spawn(self._confirm_down(peer_id, reporter))

    async def _confirm_down(self, peer_id: bytes, reporter: bytes | None) -> None:
        try:
            if await self._reachability.reachable(peer_id, self._probe_timeout):
                return
            why = "unreachable, probe failed" + (f" (reported by {short_id(reporter)})" if reporter else "")
            if self._drop(peer_id, why, close_link=True) and reporter is None:
                await self._broadcast_peer_down(peer_id)
        finally:
            self._probing.discard(peer_id)

    async def _broadcast_peer_down(self, peer_id: bytes) -> None:
        report = mesh.PeerDown(peer_id=peer_id, gen=NODE_PROTOCOL_GENERATION).SerializeToString()

        async def tell(link: PeerLink) -> None:
            await request_reply(link, StreamType.PEER_DOWN, report, timeout=self._gossip_timeout)

        links = [link for link in self._connections.links.live() if link.peer_id != peer_id]
        await asyncio.gather(*(tell(link) for link in links), return_exceptions=True)

    async def serve_peer_down(self, stream: FramedStream) -> None:
        report = await read_message(stream, mesh.PeerDown, self._gossip_timeout)
        validate_peer_down(report)
        reported = bytes(report.peer_id)
        action = resolve_peer_down(
            reported_id=reported,
            reporter_id=stream.peer_id,
            self_id=self._state.node_id,
            known=reported in self._state.table,
        )
        if action is PeerDownAction.REJECT_SELF_REPORT:
            raise MeshRefusal(mesh.MESH_ERROR_SELF_REPORT)
        if action is PeerDownAction.PROBE:
            log.info("peer %s reports %s down; probing", short_id(stream.peer_id), short_id(reported))
            self.suspect(reported, reporter=stream.peer_id)

    async def serve_peer_leaving(self, stream: FramedStream) -> None:
        notice = await read_message(stream, mesh.PeerLeaving, self._gossip_timeout)
        validate_peer_leaving(notice)
        action = resolve_peer_leaving(leaving_id=bytes(notice.peer_id), authenticated_peer_id=stream.peer_id)
        if action is PeerLeavingAction.REJECT_FORGED:
            # Logged (rate-limited) by the dispatcher with the stream refusal.
            named = short_id(bytes(notice.peer_id))
            raise MeshRefusal(mesh.MESH_ERROR_SENDER_MISMATCH, f"forged PeerLeaving naming {named}")
        self._drop(stream.peer_id, "left the mesh", close_link=False)

    async def send_leaving(self, link: PeerLink) -> None:
        """Tell the peer on ``link`` that this node leaves, and wait (a little) for it to drop us."""
        notice = mesh.PeerLeaving(peer_id=self._state.node_id, gen=NODE_PROTOCOL_GENERATION)
        try:
            # The peer ends the stream once it has dropped us.
            await request_reply(
                link, StreamType.PEER_LEAVING, notice.SerializeToString(), timeout=self._leave_timeout
            )
        except PEER_FAILURES as exc:
            log.debug(
                "PeerLeaving to %s not confirmed: %s", short_id(link.peer_id), exc or type(exc).__name__
            )

    async def serve_probe(self, stream: FramedStream) -> None:
        probe = await read_message(stream, mesh.Probe, self._probe_timeout)
        validate_probe(probe)
        await stream.send_frame(probe.SerializeToString())

    def drop(self, peer_id: bytes, reason: str) -> bool:
        """Drop ``peer_id`` as gone (SWIM confirmed it down) and close its link; whether it was known.
        The removal is refutable (:meth:`MeshState.removed_as_down`): our probes may have been wrong."""
        return self._drop(peer_id, reason, close_link=True, refutable=True)

    def _drop(self, peer_id: bytes, reason: str, *, close_link: bool, refutable: bool = False) -> bool:
        removed = self._state.remove_peer(
            peer_id, reason=reason, now_ns=time.monotonic_ns(), refutable=refutable
        )
        if not removed:
            return False
        log.info("dropped peer %s: %s", short_id(peer_id), reason)
        link = self._connections.links.get(peer_id)
        if close_link and link is not None:
            link.close(f"dropped: {reason}")
        return True


__all__ = ["Liveness"]
