"""The one link a node keeps to each peer.

Two links to one peer come up when both sides dial each other at once, or when
the peer reconnects; :func:`~meshnode.mesh.rules.keep_new_link` picks the
survivor, and because both ends apply the same rule to the same two links they
keep the same one. Callers that want a link to a peer at the same time share one
dial. The transport reports links coming and going (the node passes its
``link_established`` / ``link_closed`` calls here); how a peer is dialed is the
caller's :data:`Dial` (see :mod:`meshnode.mesh.peer_dialer`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from meshnode.identity import short_id
from meshnode.mesh.rules import LinkCandidate, keep_new_link
from meshnode.transport.base import PeerLink

log = logging.getLogger(__name__)

# Makes a new link to a peer; its failures reach every caller waiting for that link.
Dial = Callable[[bytes], Coroutine[Any, Any, PeerLink]]


def link_candidate(link: PeerLink, local_id: bytes) -> LinkCandidate:
    """``link`` as the tie-break sees it from the node ``local_id``: who dialed it, and when it came up.

    Both ends name the same dialer for one link, so they rank it the same.
    """
    dialer = local_id if link.initiated_locally else link.peer_id
    return LinkCandidate(dialer_id=dialer, established_at=link.established_at, direct=link.relay_id is None)


class PeerLinks:
    def __init__(self, local_id: bytes, *, race_window: float, relayed_drain_s: float = 2.0) -> None:
        self._local_id = local_id
        # Links to one peer that came up this close together are a simultaneous dial.
        self._race_window = race_window
        # A relayed link a direct one replaced serves what it carries this long before it closes
        # (a gossip exchange or a probe finishes; a session's stream re-opens on the direct link
        # when it closes, its unanswered units sent again as the same steps).
        self._relayed_drain_s = relayed_drain_s
        self._links: dict[bytes, PeerLink] = {}
        self._dials: dict[bytes, asyncio.Task[PeerLink]] = {}

    def get(self, peer_id: bytes) -> PeerLink | None:
        """The live link kept for ``peer_id``, or ``None``."""
        link = self._links.get(peer_id)
        return link if link is not None and not link.is_closed else None

    def live(self) -> list[PeerLink]:
        """Every live link kept, one per peer."""
        return [link for link in self._links.values() if not link.is_closed]

    def kept(self, dialed: PeerLink) -> PeerLink:
        """The link to use after dialing ``dialed``: a simultaneous dial may have kept the peer's instead."""
        return self.get(dialed.peer_id) or dialed

    async def connect(self, peer_id: bytes, dial: Dial) -> PeerLink:
        """The live link to ``peer_id``, else the result of the one dial every caller waits on.

        A caller that gives up (is cancelled) leaves the dial running for the others.
        """
        link = self.get(peer_id)
        if link is not None:
            return link
        task = self._dials.get(peer_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(dial(peer_id))
            self._dials[peer_id] = task
            task.add_done_callback(functools.partial(self._dial_finished, peer_id))
        return await asyncio.shield(task)

    def _dial_finished(self, peer_id: bytes, task: asyncio.Task[PeerLink]) -> None:
        self._dials.pop(peer_id, None)
        # Every waiter may have given up (cancelled); the outcome is still consumed
        # here, so a failed dial is not reported as an unretrieved task exception.
        if not task.cancelled():
            task.exception()

    def add(self, link: PeerLink) -> None:
        """A link came up (dialed or accepted): keep it, or close whichever of two links loses."""
        existing = self.get(link.peer_id)
        if existing is None or existing is link:
            self._links[link.peer_id] = link
            return
        keep_new = keep_new_link(
            link_candidate(existing, self._local_id),
            link_candidate(link, self._local_id),
            race_window=self._race_window,
        )
        loser = existing if keep_new else link
        if not keep_new:
            log.debug("two links to %s; closing %s", short_id(link.peer_id), loser.description)
            link.close(
                "a direct link is kept"
                if link.relay_id is not None and existing.relay_id is None
                else "duplicate link"
            )
            return
        self._links[link.peer_id] = link
        if existing.relay_id is not None and link.relay_id is None:
            existing.supersede()
            log.info(
                "direct link to %s (%s) replaces the relayed one; closing it in %.1f s",
                short_id(link.peer_id),
                link.description,
                self._relayed_drain_s,
            )
            asyncio.get_running_loop().call_later(
                self._relayed_drain_s, existing.close, "replaced by a direct link"
            )
            return
        log.debug("two links to %s; closing %s", short_id(link.peer_id), loser.description)
        existing.close("replaced by a newer link")

    def remove(self, link: PeerLink) -> bool:
        """A link went down: forget it, unless another link to the peer already replaced it.
        True when it was the link kept for its peer."""
        if self._links.get(link.peer_id) is link:
            del self._links[link.peer_id]
            return True
        return False


__all__ = ["Dial", "PeerLinks", "link_candidate"]
