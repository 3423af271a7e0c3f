"""When full gossip has outgrown its mesh, and what to tell the person running the node. Pure.

Under ``--gossip full`` every heartbeat a node sends its whole table to every member it knows, so
what each member pays grows with the square of the mesh (bench/scale.py: 0.86 MB a heartbeat at
32 members, 56 MB at 255). Delta gossip (``--gossip delta``) keeps it about flat, but a node cannot
switch alone: every member should run the same mode. So the node says so in its log, once when
the table passes :data:`FULL_GOSSIP_ADVISED_MEMBERS` and again each time it doubles, rather than
at every beat.
"""

from __future__ import annotations

# Above this many members full gossip's whole-table exchanges cost each member several MB a
# heartbeat (bench/scale.py), where delta gossip's cost a few KB.
FULL_GOSSIP_ADVISED_MEMBERS = 64


class FullGossipAdvice:
    """Whether a heartbeat's table size is news worth a warning."""

    def __init__(self, threshold: int = FULL_GOSSIP_ADVISED_MEMBERS) -> None:
        self._next_warning_at = threshold

    def at_beat(self, members: int) -> str | None:
        """The warning for a table of ``members`` peers, or None (not past the next step yet)."""
        if members <= self._next_warning_at:
            return None
        while self._next_warning_at < members:
            self._next_warning_at *= 2
        return (
            f"the mesh has {members} members: under --gossip full each heartbeat this node sends "
            f"its whole table to each of them (traffic grows with the square of the mesh); restart "
            f"every member with --gossip delta (digests with a few peers, SWIM probes)"
        )


__all__ = ["FULL_GOSSIP_ADVISED_MEMBERS", "FullGossipAdvice"]
