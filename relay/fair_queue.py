"""One destination's queue: per-source sub-queues served by deficit round robin.

Each sender to a destination has its own sub-queue and the sub-queues take turns
by bytes (DRR, Shreedhar & Varghese): a sender flooding a destination gets its
share and no more, and a frame from a quiet sender waits behind at most one
quantum-sized turn of each busy sender. Within a sender's sub-queue its channels
take turns too (:class:`~meshnode.relaywire.channel_turns.ChannelTurns`: a
channel's frames in order, control frames a barrier, at most
:data:`MAX_OVERTAKEN` earlier frames passed, well inside the receiver's replay
window), so a decode step does not wait behind a transfer on the same link.
Admission limits (bytes per sender, per destination, per relay) are the
caller's; this class only counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshnode.relaywire.channel_turns import CONTROL_CHANNEL, ChannelTurns

# Half the sealed sessions' replay window (2 048 counters): a frame reordered at the relay
# still authenticates at the receiver.
MAX_OVERTAKEN = 1024


@dataclass
class _SubQueue:
    frames: ChannelTurns[bytes] = field(default_factory=lambda: ChannelTurns(MAX_OVERTAKEN))
    nbytes: int = 0
    deficit: int = 0


class FairQueue:
    def __init__(self, quantum_bytes: int, frame_overhead: int = 0) -> None:
        if quantum_bytes <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = quantum_bytes
        # Added to every frame's size in all byte counts (``nbytes``, shares, deficits),
        # so a flood of empty frames is bounded by byte budgets too.
        self.frame_overhead = frame_overhead
        self.nbytes = 0
        self.nframes = 0
        self._subqueues: dict[bytes, _SubQueue] = {}
        # Sources with queued frames, in service order.
        self._active: deque[bytes] = deque()

    def __len__(self) -> int:
        return self.nframes

    def source_bytes(self, source: bytes) -> int:
        sub = self._subqueues.get(source)
        return sub.nbytes if sub is not None else 0

    @property
    def active_sources(self) -> int:
        return len(self._active)

    def cost(self, frame: bytes) -> int:
        return len(frame) + self.frame_overhead

    def push(self, source: bytes, frame: bytes, channel: int = CONTROL_CHANNEL) -> None:
        """Queue ``frame``, which ``source`` sent on ``channel`` (the default keeps it in
        order with everything the source queued)."""
        sub = self._subqueues.get(source)
        if sub is None:
            sub = self._subqueues[source] = _SubQueue()
            self._active.append(source)
        cost = len(frame) + self.frame_overhead
        sub.frames.push(channel, frame)
        sub.nbytes += cost
        self.nbytes += cost
        self.nframes += 1

    def pop(self) -> tuple[bytes, bytes] | None:
        """The next ``(source, frame)`` in fair order, or ``None`` when empty."""
        active = self._active
        if not active:
            return None
        subqueues = self._subqueues
        # Each pass either serves the head source or grants it a quantum and moves on,
        # so a frame of size S is served within ceil(S / quantum) rounds.
        while True:
            source = active[0]
            sub = subqueues[source]
            head = sub.frames.peek()
            cost = len(head) + self.frame_overhead
            if cost <= sub.deficit:
                sub.frames.pop()
                sub.deficit -= cost
                sub.nbytes -= cost
                self.nbytes -= cost
                self.nframes -= 1
                if not sub.frames:
                    # An idle source keeps no credit (DRR), and no entry.
                    del subqueues[source]
                    active.popleft()
                return source, head
            sub.deficit += self.quantum
            active.rotate(-1)

    def drop_source(self, source: bytes) -> int:
        """Discard everything ``source`` queued; returns the bytes (costs) freed."""
        sub = self._subqueues.pop(source, None)
        if sub is None:
            return 0
        self._active.remove(source)
        self.nbytes -= sub.nbytes
        self.nframes -= len(sub.frames)
        return sub.nbytes

    def clear(self) -> int:
        """Discard everything; returns the bytes (costs) freed."""
        freed = self.nbytes
        self._subqueues.clear()
        self._active.clear()
        self.nbytes = 0
        self.nframes = 0
        return freed


__all__ = ["MAX_OVERTAKEN", "FairQueue"]
