"""Session leases at a shard: who holds a session, how long it lives unused, and why it ended.

Pure rules the worker applies (:mod:`.worker`); nothing here keeps state or reads a clock.

- A session's *owner* is the peer whose stream opened it (:class:`StreamOrigin`), and it
  lives on the link of the owner's latest stream for it. That link closing, or membership
  confirming the owner down or gone, ends the session after a short grace in which the
  owner may still show up (a link re-dialed, a relay restarted): nobody else can finish it.
- A session also ends when no frame for it arrives within its idle timeout. A unit with
  an envelope deadline says how long its sender is prepared to wait, so that becomes the
  timeout (:func:`idle_timeout_ns`); a far deadline cannot stretch it past the default,
  or one frame could pin a slot for as long as its sender likes.
- A peer other than this node itself holds at most :func:`peer_session_cap` sessions, so a
  member cannot take the slots that the node's own API users need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class ReleaseReason(Enum):
    """Why a session's state was dropped (the label of ``meshnode_session_releases_total``)."""

    # A Release (signal or unary RPC) asked for it.
    RELEASED = "released"
    # A stream opened a newer epoch of the same route session.
    SUPERSEDED = "superseded"
    # The owner's link closed (peer gone, QUIC idle timeout) and it did not come back in time.
    LINK_CLOSED = "link_closed"
    # Membership confirmed the owner down (probe failed) or it left, and it did not come back.
    OWNER_DEPARTED = "owner_departed"
    # No frame for it within its idle timeout.
    IDLE = "idle"


@dataclass(frozen=True)
class StreamOrigin:
    """Who opened a session stream: the authenticated peer, and whether that is this node's own
    head (``local``), which no per-peer share applies to."""

    peer_id: bytes = b""
    local: bool = True


# Streams registered without an origin: the worker's own callers (tests, a standalone node).
LOCAL_ORIGIN = StreamOrigin()


@dataclass(frozen=True)
class LeaseConfig:
    """A serving node's lease rules, in seconds (its command-line options, :mod:`meshnode.app.lease_options`)."""

    # A session no frame arrived for in this long ends; a unit's deadline shortens it.
    idle_timeout_s: float = 120.0
    # The most of this shard's sessions one peer other than this node may hold (3 of 4).
    peer_share: float = 0.75
    # How long a session whose owner seems gone waits for it to show up again.
    owner_grace_s: float = 5.0


def idle_timeout_ns(deadline_ns: int | None, arrival_ns: int, *, default_ns: int, floor_ns: int) -> int:
    """How long a session may go without a frame after one that carried ``deadline_ns`` (None:
    none), both on one clock.

    The time left to the deadline, but never below ``floor_ns`` (a deadline that is nearly
    due must not drop the session the moment its unit finishes) nor above ``default_ns``.
    """
    floor_ns = min(floor_ns, default_ns)
    if deadline_ns is None:
        return default_ns
    return min(default_ns, max(floor_ns, deadline_ns - arrival_ns))


def peer_session_cap(share: float, max_sessions: int) -> int:
    """Sessions one peer other than this node may hold: ``ceil(share × max_sessions)``, at least
    one (a node whose share rounds to nothing would serve no peer at all), at most all."""
    # The epsilon keeps a product like 0.7 × 10 = 7.000000000000001 from rounding up to 8.
    return max(1, min(max_sessions, math.ceil(share * max_sessions - 1e-9)))


__all__ = [
    "LOCAL_ORIGIN",
    "LeaseConfig",
    "ReleaseReason",
    "StreamOrigin",
    "idle_timeout_ns",
    "peer_session_cap",
]
