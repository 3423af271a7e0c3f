"""Whether a peer that left a probe unanswered gets a second one, and how (pure).

A relay that dies without closing keeps its connection for its idle timeout
(15 s), so a probe on a link through it goes unanswered although another relay
the peer uses reaches it: the second probe gives that link up and dials around
its relay. A peer that reconnected during the probe (its new link came up after
the probe began, typically because it moved to another relay first) gets a whole
probe on the new link. A direct link that stayed silent gets no second probe, unless it was a
path to a peer behind NAT (punched, or across a LAN): the peer's relay stands in for it.

A probe refused outright (in well under its timeout: the peer's relay says it is not
registered there) does not confirm the peer down either while a probe's time has not
passed: a relay that restarts has its nodes register again one by one, each some
hundreds of milliseconds apart, and the first one back used to drop every peer not yet
back (:func:`retry_refused_in`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class ProbedLink(Protocol):
    """What the decision reads of a link (a :class:`meshnode.transport.base.PeerLink`)."""

    @property
    def relay_id(self) -> bytes | None: ...
    @property
    def established_at(self) -> float: ...
    @property
    def last_heard_at(self) -> float: ...
    @property
    def is_closed(self) -> bool: ...


Link = TypeVar("Link", bound=ProbedLink)


@dataclass(frozen=True)
class Reprobe(Generic[Link]):
    # The link to close before it: new work must not go to it either.
    give_up: Link | None

    @property
    def avoid_relays(self) -> tuple[bytes, ...]:
        """Relays new links for the second probe do not go through: the given-up link's."""
        relay = self.give_up.relay_id if self.give_up is not None else None
        return (relay,) if relay is not None else ()


def reprobe_after(
    unanswered: Link | None,
    current: ProbedLink | None,
    probe_began_at: float,
    *,
    reachable_otherwise: bool = False,
) -> Reprobe[Link] | None:
    """The second probe after one that began at ``probe_began_at`` on ``unanswered``; ``None``: none.

    ``current`` is the link kept for the peer now (``None``: none), ``unanswered``
    the one the first probe began on (``None``: it had none and dialed none).
    ``reachable_otherwise``: ``unanswered`` is a direct path to a peer behind NAT (punched, or
    across a LAN), which its relay stands in for: it is given up, and the peer probed there.
    """
    if current is not None and current.established_at >= probe_began_at:
        return Reprobe(give_up=None)
    if unanswered is None or (unanswered.relay_id is None and not reachable_otherwise):
        return None
    return Reprobe(give_up=unanswered)


def heard_during_probe(link: ProbedLink | None, probe_began_at: float) -> bool:
    """Whether the peer sent on ``link``, still open, after a probe on it began at ``probe_began_at``.

    Such a peer is slow to answer, not gone: a relayed link carrying a bulk transfer over a
    lossy path (the NAT lab under 20% loss) queues the probe's echo behind the transfer's data
    for seconds, and giving the link up then ends the transfer too.
    """
    return link is not None and not link.is_closed and link.last_heard_at > probe_began_at


# A probe that failed within this share of its timeout was refused, not left unanswered.
REFUSED_WITHIN_SHARE = 0.5
# How long to wait before probing a peer whose probe was refused.
REFUSED_RETRY_INTERVAL_S = 0.5


def retry_refused_in(
    first_began_at: float, began_at: float, failed_at: float, probe_timeout: float
) -> float | None:
    """Seconds to wait before probing again a peer whose probe began at ``began_at`` and failed
    at ``failed_at`` (the first of this confirmation began at ``first_began_at``); ``None``: the
    peer is confirmed down. A refused probe is retried until ``probe_timeout`` has passed since
    the first; an unanswered one is not."""
    refused = failed_at - began_at < REFUSED_WITHIN_SHARE * probe_timeout
    if not refused or failed_at + REFUSED_RETRY_INTERVAL_S >= first_began_at + probe_timeout:
        return None
    return REFUSED_RETRY_INTERVAL_S


__all__ = [
    "REFUSED_RETRY_INTERVAL_S",
    "REFUSED_WITHIN_SHARE",
    "ProbedLink",
    "Reprobe",
    "heard_during_probe",
    "reprobe_after",
    "retry_refused_in",
]
