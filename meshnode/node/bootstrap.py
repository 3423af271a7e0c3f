"""How a node gets into the mesh: an invite holder joins through the invite's bootstrap peers
(:meth:`Bootstrap.join`), a member that restarted gossips with the peers it knew
(:meth:`Bootstrap.reconnect`). Both are gossip exchanges (:class:`~meshnode.node.gossip.Gossip`);
what one grants is the mesh state's, and the membership it leaves is saved by the keeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint
from meshnode.mesh.state import MeshState
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.config import JoinError
from meshnode.node.gossip import Gossip
from meshnode.node.membership_keeper import MembershipKeeper
from meshnode.node.peer_connections import PeerConnections
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal, in_words

log = logging.getLogger(__name__)


class Bootstrap:
    def __init__(
        self,
        state: MeshState,
        keeper: MembershipKeeper,
        connections: PeerConnections,
        gossip: Gossip,
        background: BackgroundTasks,
        known_peers: list[Endpoint],
    ) -> None:
        """``known_peers``: the node's peers to dial by address besides the table's."""
        self._state = state
        self._keeper = keeper
        self._connections = connections
        self._gossip = gossip
        self._background = background
        self._known_peers = known_peers

    async def join(self) -> None:
        """Invite holder: dial bootstrap peers until one admits us and grants membership."""
        assert self._state.invite is not None
        reasons: list[str] = []
        refused = False
        invite_relays = [r.id for r in self._state.invite.relays]
        for endpoint in self._state.invite.bootstrap:
            try:
                link = await self._connections.dial_endpoint(endpoint, via=invite_relays)
                await self._gossip.exchange(link)
            except RemoteRefusal as refusal:
                log.warning(
                    "bootstrap peer %s refused us: %s", endpoint, in_words(refusal.code, refusal.detail)
                )
                reasons.append(in_words(refusal.code, refusal.detail))
                refused = True
                if self._keeper.removal.is_set():
                    break  # a verified revocation names us: no other member will admit us
                continue
            except MeshRefusal as refusal:
                # An answer, though one we refuse (another mesh, a forged grant): no retry helps.
                log.warning("bootstrap peer %s answered what we refuse: %s", endpoint, refusal)
                reasons.append(f"{endpoint}: {refusal}")
                refused = True
                continue
            except PEER_FAILURES as exc:
                log.warning("bootstrap peer %s failed: %s", endpoint, exc or type(exc).__name__)
                reasons.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            if self._state.is_member:
                self._keeper.save_membership()
                log.info("joined mesh %s via %s", self._state.mesh_id, short_id(endpoint.id))
                return
        if refused or not reasons:
            raise JoinError("join refused: " + ("; ".join(reasons) or "no bootstrap peers"), refused=True)
        raise JoinError("no bootstrap peer reachable: " + "; ".join(reasons), refused=False)

    async def reconnect(self) -> int:
        """Member restart: gossip with the peers we knew until one answers; returns how many had.

        Gossip names the rest, and the dials to the others go on: one that stopped for good (the
        stored peers keep those) must not hold the node's start for its dial timeout."""
        dials = [
            self._background.spawn(self._gossip.with_known_peer(e))
            for e in self._known_peers
            if e.id != self._state.node_id
        ]
        for dial in asyncio.as_completed(dials):
            with contextlib.suppress(Exception):  # logged as the background task it is
                if await dial:
                    break
        reached = sum(1 for d in dials if d.done() and not d.cancelled() and not d.exception() and d.result())
        if dials:
            later = "" if all(d.done() for d in dials) else " so far (still dialing the others)"
            log.info(
                "rejoined mesh %s: %d of %d known peers answered%s",
                self._state.mesh_id,
                reached,
                len(dials),
                later,
            )
        return reached


__all__ = ["Bootstrap"]
