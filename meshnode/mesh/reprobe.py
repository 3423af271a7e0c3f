"""Whether a peer that left a probe unanswered gets a second one, and how (pure).

A relay that dies without closing keeps its connection for its idle timeout
(15 s), so a probe on a link through it goes unanswered although another relay
the peer uses reaches it: the second probe gives that link up and dials around
its relay. A peer that reconnected during the probe (its new link came up after
the probe began, typically because it moved to another relay first) gets a whole
probe on the new link. A direct link that stayed silent gets no second probe.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.transport.base import PeerLink


@dataclass(frozen=True)
class Reprobe:
    # The link to close before it: new work must not go to it either.
    give_up: PeerLink | None

    @property
    def avoid_relays(self) -> tuple[bytes, ...]:
        """Relays new links for the second probe do not go through: the given-up link's."""
        relay = self.give_up.relay_id if self.give_up is not None else None
        return (relay,) if relay is not None else ()


def reprobe_after(
    unanswered: PeerLink | None, current: PeerLink | None, probe_began_at: float
) -> Reprobe | None:
    """The second probe after one that began at ``probe_began_at`` on ``unanswered``; ``None``: none.

    ``current`` is the link kept for the peer now (``None``: none), ``unanswered``
    the one the first probe began on (``None``: it had none and dialed none).
    """
    if current is not None and current.established_at >= probe_began_at:
        return Reprobe(give_up=None)
    if unanswered is None or unanswered.relay_id is None:
        return None
    return Reprobe(give_up=unanswered)


__all__ = ["Reprobe", "reprobe_after"]
