"""What a relay client sends next: destinations take turns, and each one's channels. Sans-IO.

All of a node's relayed links share one connection to their relay, and the relay keeps one
sender's frames to a peer in the order it got them, so what the client sends first reaches
the peer first. Queued in one FIFO, a decode step waited behind everything a transfer on the
same link had queued; here each destination's channels take turns
(:class:`~meshnode.relaywire.channel_turns.ChannelTurns`, with the ordering rules the
receiver relies on) and the destinations take turns too.

Records are sealed when they leave (``OutgoingRecord.seal``), so a sealed session's counters
follow the order on the wire and the client's reordering costs no replay-window room.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from meshnode.relaywire.channel_turns import ChannelTurns

# Seals a record for the wire when it leaves; ``None`` drops it (its link is gone).
Sealer = Callable[[int, bytes], "bytes | None"]


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    channel: int
    data: bytes
    # None: ``data`` is already the payload to send (a handshake message).
    seal: Sealer | None = None

    def payload(self) -> bytes | None:
        return self.data if self.seal is None else self.seal(self.channel, self.data)


class SendTurns:
    """The records a relay client has yet to send, per destination; ``pop`` gives the next."""

    def __init__(self) -> None:
        self._destinations: dict[bytes, ChannelTurns[OutgoingRecord]] = {}
        # Destinations with records queued, in service order.
        self._order: deque[bytes] = deque()

    def __bool__(self) -> bool:
        return bool(self._order)

    def __len__(self) -> int:
        return sum(len(queued) for queued in self._destinations.values())

    def push(self, destination: bytes, record: OutgoingRecord) -> None:
        queued = self._destinations.get(destination)
        if queued is None:
            queued = self._destinations[destination] = ChannelTurns()
            self._order.append(destination)
        queued.push(record.channel, record)

    def pop(self) -> tuple[bytes, OutgoingRecord] | None:
        """The next ``(destination, record)``, or ``None`` when nothing is queued."""
        if not self._order:
            return None
        destination = self._order.popleft()
        queued = self._destinations[destination]
        record = queued.pop()
        if queued:
            self._order.append(destination)
        else:
            del self._destinations[destination]
        return destination, record

    def clear(self) -> None:
        self._destinations.clear()
        self._order.clear()


__all__ = ["OutgoingRecord", "Sealer", "SendTurns"]
