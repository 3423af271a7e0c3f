"""Which few peers a member keeps links with for gossip: a partial view, HyParView-style.

A member of a large mesh does not link with everyone. It keeps an *active view* of at
most ``active_size`` peers, the only ones it gossips with, and a *passive view* of at
most ``passive_size`` more, from which a lost active peer is replaced. As in
HyParView (Leitão, Pereira, Rodrigues, 2007) the active view is symmetric: a peer
that opens to us enters ours (:meth:`PartialView.accept`), evicting a random one
when it is full, so links held per member stay at most ``active_size``; and a shuffle
swaps one active peer for a passive one now and then, so the graph keeps mixing and a
partition's two sides find each other again once the network heals.

Unlike HyParView, the views are drawn from the peer table rather than learned by
random walks: delta gossip gives every member every record, so the table is already
a uniform sample of the mesh. Links for the data plane are not the view's business:
they are made on demand to a route's hops. Pure and synchronous: the edge dials what
:meth:`targets` names and reports back through :meth:`accept`, :meth:`drop` and
:meth:`refresh`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

DEFAULT_ACTIVE_SIZE = 8
DEFAULT_PASSIVE_SIZE = 32


class PartialView:
    def __init__(
        self,
        self_id: bytes,
        *,
        active_size: int = DEFAULT_ACTIVE_SIZE,
        passive_size: int = DEFAULT_PASSIVE_SIZE,
        rng: random.Random | None = None,
    ) -> None:
        if active_size < 1 or passive_size < 0:
            raise ValueError("an active view holds at least one peer")
        self.self_id = self_id
        self.active_size = active_size
        self.passive_size = passive_size
        self._rng = rng or random.Random()
        self._active: list[bytes] = []
        self._passive: list[bytes] = []

    @property
    def active(self) -> tuple[bytes, ...]:
        return tuple(self._active)

    @property
    def passive(self) -> tuple[bytes, ...]:
        return tuple(self._passive)

    def refresh(self, known: Collection[bytes]) -> None:
        """Forget peers no longer in ``known`` (the table); top the passive view up from it and
        the active view from the passive one."""
        self._active = [p for p in self._active if p in known]
        self._passive = [p for p in self._passive if p in known and p not in self._active]
        self._top_up_passive(known)
        while len(self._active) < self.active_size and self._passive:
            self._active.append(self._passive.pop(self._rng.randrange(len(self._passive))))
        self._top_up_passive(known)

    def _top_up_passive(self, known: Collection[bytes]) -> None:
        if len(self._passive) >= self.passive_size:
            return
        taken = set(self._active) | set(self._passive) | {self.self_id}
        candidates = [p for p in known if p not in taken]
        wanted = min(self.passive_size - len(self._passive), len(candidates))
        self._passive.extend(self._rng.sample(candidates, wanted))

    def targets(self, fanout: int, synced: Collection[bytes] = ()) -> list[bytes]:
        """The peers to gossip with this round: ``fanout`` of the active view, at random, less
        those ``synced`` with us already this round. An exchange is push-pull, so one the peer
        opened to us left nothing for ours to carry (what changed since reaches it next round);
        skipping it saves about a fifth of the exchanges of a view of 8 and a fanout of 3."""
        chosen = self._rng.sample(self._active, min(fanout, len(self._active)))
        return [peer_id for peer_id in chosen if peer_id not in synced]

    def accept(self, peer_id: bytes) -> bytes | None:
        """``peer_id`` linked with us: it joins the active view (a link is in both peers' views).
        Returns the peer evicted to make room, whose link the edge closes, or None."""
        if peer_id == self.self_id or peer_id in self._active:
            return None
        if peer_id in self._passive:
            self._passive.remove(peer_id)
        evicted = None
        if len(self._active) >= self.active_size:
            evicted = self._active.pop(self._rng.randrange(len(self._active)))
            self._to_passive(evicted)
        self._active.append(peer_id)
        return evicted

    def drop(self, peer_id: bytes, *, failed: bool) -> None:
        """The link to ``peer_id`` closed: a peer that failed is forgotten, one that evicted us
        (or that we evicted) waits in the passive view."""
        if peer_id in self._active:
            self._active.remove(peer_id)
        if failed:
            if peer_id in self._passive:
                self._passive.remove(peer_id)
        else:
            self._to_passive(peer_id)

    def shuffle(self) -> tuple[bytes, bytes] | None:
        """Swap a random active peer for a random passive one; (left, joined), or None when a view
        is empty. The edge closes the link to the one that left and opens one to the one that joined."""
        if not self._active or not self._passive:
            return None
        left = self._active.pop(self._rng.randrange(len(self._active)))
        joined = self._passive.pop(self._rng.randrange(len(self._passive)))
        self._active.append(joined)
        self._to_passive(left)
        return left, joined

    def _to_passive(self, peer_id: bytes) -> None:
        if peer_id in self._passive or peer_id == self.self_id:
            return
        if len(self._passive) >= self.passive_size and self._passive:
            self._passive.pop(self._rng.randrange(len(self._passive)))
        if self.passive_size:
            self._passive.append(peer_id)


def links_to_close(
    stream_counts: Mapping[bytes, int | None],
    active: Collection[bytes],
    busy: Collection[bytes],
    quiet: Collection[bytes],
) -> list[bytes]:
    """The peers whose link to close: outside the ``active`` view, carrying no stream, not
    ``busy`` (an exchange or a probe under way, which may not have opened its stream yet), and
    ``quiet``: no stream was open on it when the caller last looked (a round ago), nor did the
    peer open one since. A stream we served ends here once we sent the reply, not once the
    peer read it, and a link closed then takes the reply with it (the peer's unread data goes
    with the link): a link is closed a round after its last stream at the soonest.

    ``stream_counts``: the streams open on each linked peer's link, None where the link cannot
    say (it is kept). A stream open is something living on the link (a route's session, a
    transfer, an exchange): a link the data plane uses is never closed for the view's sake, and
    one it made to a route's hop and no longer uses is made again on demand.
    """
    return [
        peer_id
        for peer_id, streams in stream_counts.items()
        if streams == 0 and peer_id not in active and peer_id not in busy and peer_id in quiet
    ]


__all__ = ["DEFAULT_ACTIVE_SIZE", "DEFAULT_PASSIVE_SIZE", "PartialView", "links_to_close"]
