"""Whether a peer answers, with the second chances a probe gets (the rules are pure, in
:mod:`meshnode.mesh.reprobe`).

- A probe unanswered on a relayed link: that link is given up and the peer probed around
  its relay, through another one it announces. Before that, the relay is pinged on our own
  connection: a relay that restarted, or died without closing, leaves that connection
  looking alive until its idle timeout (15 s); one that answers nothing is registered with
  again at once, and the peer asked through it once more.
- A probe unanswered on a direct path to a peer behind NAT (punched, across a LAN): that
  link is given up and the peer probed through its relay.
- A probe unanswered on a link the peer sent on meanwhile counts as answered: the peer is
  slow (its echo queued behind a transfer on a lossy relayed path), not gone.
- A probe refused outright (the relay says the peer is not registered there) is retried
  for a probe's time: the nodes of a relay that came back register again one by one.

It reads what it needs from the node's public side (:class:`PeerAccess`: its links and
relay links) and from its direct paths (:class:`OtherPaths`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection
from typing import Protocol

from meshnode.identity import short_id
from meshnode.mesh.reprobe import heard_during_probe, reprobe_after, retry_refused_in
from meshnode.mesh.validation import decode
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.relaylink.client import RelayCheck
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.base import PeerLink
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION, StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


class PeerAccess(Protocol):
    """The node's links: a link on which gossip completed, the one kept now, and its relays."""

    @property
    def relay_links(self) -> RelayLinks | None: ...

    async def get_link(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink: ...

    def link_to(self, peer_id: bytes) -> PeerLink | None: ...


class OtherPaths(Protocol):
    def reachable_otherwise(self, link: PeerLink) -> bool:
        """Whether a peer silent on ``link`` may still answer another way (another relay; its
        relay, for a direct path to a peer behind NAT)."""
        ...


class Reachability:
    def __init__(self, peers: PeerAccess, other_paths: OtherPaths) -> None:
        self._peers = peers
        self._other_paths = other_paths

    async def probe_on_link(
        self, peer_id: bytes, avoid_relays: Collection[bytes], timeout: float
    ) -> tuple[bool, PeerLink | None]:
        """Whether the peer echoed a PROBE within ``timeout``, and the link the probe began on.

        That is the link kept when the probe started, else the one it dialed (``None``: none).
        A new link does not go through ``avoid_relays``.
        """
        nonce = os.urandom(16)
        link = self._peers.link_to(peer_id)
        try:
            async with asyncio.timeout(timeout):
                used = await self._peers.get_link(peer_id, avoid_relays)
                link = link or used
                probe = mesh.Probe(gen=NODE_PROTOCOL_GENERATION, nonce=nonce).SerializeToString()
                data = await request_reply(used, StreamType.PROBE, probe, timeout=None)
        except PEER_FAILURES:
            return False, link
        if data is None:
            return False, link
        try:
            return decode(mesh.Probe, data).nonce == nonce, link
        except MeshRefusal:
            return False, link

    async def reachable(self, peer_id: bytes, timeout: float) -> bool:
        """Whether the peer answers a probe of ``timeout`` seconds, or its second chances."""
        clock = asyncio.get_running_loop().time
        began_at = clock()
        answered, unanswered = await self._probe_or_hear(peer_id, (), timeout)
        if answered:
            return True
        again = reprobe_after(
            unanswered,
            self._peers.link_to(peer_id),
            began_at,
            reachable_otherwise=unanswered is not None and self._other_paths.reachable_otherwise(unanswered),
        )
        if again is None:
            wait = retry_refused_in(began_at, began_at, clock(), timeout)
            if wait is None:
                return False
            await asyncio.sleep(wait)
            return await self._probe_while_refused(peer_id, (), timeout, began_at)
        avoid = again.avoid_relays
        given_up = again.give_up
        if given_up is not None and given_up.relay_id is None:
            given_up.close("no answer on this direct path")
            log.info(
                "peer %s did not answer on %s; trying its relay", short_id(peer_id), given_up.description
            )
        elif given_up is not None:
            given_up.close("no answer through this relay")
            if await self._relay_registered_again(given_up.relay_id, timeout):
                avoid = ()
            log.info(
                "peer %s did not answer through %s; trying %s",
                short_id(peer_id),
                given_up.description,
                "its other relays (it again if there are none)" if avoid else "again",
            )
        return await self._probe_while_refused(peer_id, avoid, timeout)

    async def _probe_or_hear(
        self, peer_id: bytes, avoid_relays: Collection[bytes], timeout: float
    ) -> tuple[bool, PeerLink | None]:
        """A probe, counted as answered when the peer sent on the probed link while it waited."""
        began_at = asyncio.get_running_loop().time()
        answered, link = await self.probe_on_link(peer_id, avoid_relays, timeout)
        if not answered and heard_during_probe(link, began_at):
            assert link is not None
            log.info(
                "peer %s left a probe unanswered on %s but sent on it meanwhile: slow, not gone",
                short_id(peer_id),
                link.description,
            )
            return True, link
        return answered, link

    async def _relay_registered_again(self, relay_id: bytes | None, timeout: float) -> bool:
        relay_links = self._peers.relay_links
        if relay_id is None or relay_links is None:
            return False
        return await relay_links.confirm_relay(relay_id, timeout) is RelayCheck.REGISTERED_AGAIN

    async def _probe_while_refused(
        self,
        peer_id: bytes,
        avoid_relays: Collection[bytes],
        timeout: float,
        refused_since: float | None = None,
    ) -> bool:
        """Probe, and again while the probes are refused outright, from ``refused_since``
        (default: this first probe's start)."""
        clock = asyncio.get_running_loop().time
        while True:
            began_at = clock()
            if refused_since is None:
                refused_since = began_at
            answered, _link = await self._probe_or_hear(peer_id, avoid_relays, timeout)
            if answered:
                return True
            wait = retry_refused_in(refused_since, began_at, clock(), timeout)
            if wait is None:
                return False
            await asyncio.sleep(wait)


__all__ = ["OtherPaths", "PeerAccess", "Reachability"]
