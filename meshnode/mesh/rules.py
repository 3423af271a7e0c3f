"""The membership protocol's decision rules, as small pure functions."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshnode.wire.framing import StreamType

# Before a peer is admitted (quarantine-until-gossip) only these are served.
STREAMS_BEFORE_ADMISSION = frozenset({StreamType.GOSSIP, StreamType.ROUTE_REQUEST})


def stream_allowed_before_admission(stream_type: StreamType) -> bool:
    return stream_type in STREAMS_BEFORE_ADMISSION


class PeerDownAction(enum.Enum):
    PROBE = "probe"  # confirm by probing before removing
    IGNORE_UNKNOWN = "ignore-unknown"  # not in our table: nothing to remove
    REJECT_SELF_REPORT = "reject-self-report"  # names the receiver or the reporter


def resolve_peer_down(
    *, reported_id: bytes, reporter_id: bytes, self_id: bytes, known: bool
) -> PeerDownAction:
    """A PeerDown report never removes anyone by itself; at most it triggers a probe."""
    if reported_id in (self_id, reporter_id):
        return PeerDownAction.REJECT_SELF_REPORT
    if not known:
        return PeerDownAction.IGNORE_UNKNOWN
    return PeerDownAction.PROBE


class PeerLeavingAction(enum.Enum):
    REMOVE_SENDER = "remove-sender"
    REJECT_FORGED = "reject-forged"  # names a node other than the authenticated sender


def resolve_peer_leaving(*, leaving_id: bytes, authenticated_peer_id: bytes) -> PeerLeavingAction:
    if leaving_id != authenticated_peer_id:
        return PeerLeavingAction.REJECT_FORGED
    return PeerLeavingAction.REMOVE_SENDER


@dataclass(frozen=True)
class LinkCandidate:
    dialer_id: bytes  # node id of the side that dialed
    established_at: float
    # Peer to peer, not through a relay.
    direct: bool = True


def keep_new_link(existing: LinkCandidate, new: LinkCandidate, *, race_window: float) -> bool:
    """Which of two links to one peer survives; both ends reach the same answer.

    A direct link beats a relayed one, whichever came first: a punched hole or a LAN
    path replaces the relay, and a working direct link is not given up for a relayed
    one (a direct path that dies is closed, and only then is the relay used again).
    Between two of a kind, two links that came up within ``race_window`` of each
    other from opposite dialers are a simultaneous dial: keep the one dialed by the
    lower node id. Otherwise the newer link wins — the peer reconnected (e.g. after a
    restart), and the old link is most likely dead.
    """
    if existing.direct != new.direct:
        return new.direct
    simultaneous = (
        abs(new.established_at - existing.established_at) <= race_window
        and new.dialer_id != existing.dialer_id
    )
    if simultaneous:
        return new.dialer_id < existing.dialer_id
    return True


@dataclass(frozen=True, order=True)
class Freshness:
    """Order of one node's announcements: a restart bumps incarnation, a heartbeat the sequence."""

    incarnation: int
    heartbeat_seq: int


class MergeAction(enum.Enum):
    ADD = "add"
    UPDATE = "update"
    IGNORE_STALE = "ignore-stale"
    IGNORE_TOMBSTONED = "ignore-tombstoned"
    IGNORE_SELF = "ignore-self"


def resolve_announcement(
    *,
    incoming: Freshness,
    current: Freshness | None,
    tombstone: Freshness | None,
    is_self: bool,
    direct: bool,
) -> MergeAction:
    """Whether a gossiped announcement of one node replaces what we hold.

    ``direct`` means the announcement came from the node itself over an
    authenticated link. A tombstoned node (left, or confirmed down) comes back
    only with something fresher than its tombstone *and* either a new incarnation
    (it restarted) or directly from itself (it is evidently alive); stale gossip
    relayed by others cannot resurrect it.
    """
    if is_self:
        return MergeAction.IGNORE_SELF
    if current is None:
        if tombstone is not None and (
            incoming <= tombstone or not (direct or incoming.incarnation > tombstone.incarnation)
        ):
            return MergeAction.IGNORE_TOMBSTONED
        return MergeAction.ADD
    if current < incoming:
        return MergeAction.UPDATE
    return MergeAction.IGNORE_STALE


__all__ = [
    "STREAMS_BEFORE_ADMISSION",
    "Freshness",
    "LinkCandidate",
    "MergeAction",
    "PeerDownAction",
    "PeerLeavingAction",
    "keep_new_link",
    "resolve_announcement",
    "resolve_peer_down",
    "resolve_peer_leaving",
    "stream_allowed_before_admission",
]
