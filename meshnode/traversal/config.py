"""How a node punches and watches its direct paths: the settings, apart from the machinery so that
the command line and the node's configuration read them without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode.traversal.pair_backoff import PunchSchedule


@dataclass(frozen=True)
class PunchTiming:
    # How long each side waits for the other's next message.
    answer_timeout_s: float = 5.0
    # How long the responder's dials may take, and the initiator waits for their result.
    connect_timeout_s: float = 5.0
    # Punch datagrams to each candidate, this far apart (a few: the first may be lost).
    datagrams: int = 5
    datagram_interval_s: float = 0.1
    # The responder starts the next candidate's dial this long after the previous one.
    dial_stagger_s: float = 0.2


@dataclass(frozen=True)
class TraversalConfig:
    hole_punching: bool = True
    schedule: PunchSchedule = field(default_factory=PunchSchedule)
    timing: PunchTiming = field(default_factory=PunchTiming)
    tick_s: float = 0.5
    # A direct path to a peer behind NAT is pinged once silent this long, and given up for the
    # relay once silent this long (Tailscale trusts a path 6.5 s without an answer).
    ping_after_s: float = 1.0
    silent_after_s: float = 5.0


__all__ = ["PunchTiming", "TraversalConfig"]
