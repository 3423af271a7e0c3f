"""One sender's frames toward one peer, whose channels take turns. Sans-IO.

A relayed link carries all of its channels on one relay connection, and both the sending
node and the relay used to keep one sender's frames to a peer in a single FIFO: a decode step
waited behind everything a bulk channel (a layer transfer) had queued, up to that channel's
1 MiB window (80 ms on loopback, seconds on a lossy path; bench/relay.py). Here the channels
take turns, one frame each, so a small exchange waits for one frame of each busy channel.

What the receiving node relies on keeps its order:

- a channel's frames (its offsets must be contiguous);
- a channel's first frame before that of any channel queued after it (the receiver takes an
  unseen channel number below the highest it has seen as finished): a channel joins the
  turns behind every channel already taking them;
- the control channel (0: handshakes, link credit, CLOSE) against everything: what was queued
  before a control frame leaves before it, what was queued after it leaves after it.

Where the frames are already sealed (at the relay), overtaking is bounded too: at most
``max_overtaken`` frames queued earlier may be passed, so a frame stays inside the receiver's
replay window (:data:`meshnode.relaylink.seal.REPLAY_WINDOW`, 2 048 counters).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

CONTROL_CHANNEL = 0

T = TypeVar("T")


@dataclass(slots=True)
class _Turns(Generic[T]):
    """Frames of data channels queued between two control frames; the channels take turns."""

    queues: dict[int, deque[T]] = field(default_factory=dict)
    order: deque[int] = field(default_factory=deque)
    pushed: int = 0

    def push(self, channel: int, item: T) -> None:
        queue = self.queues.get(channel)
        if queue is None:
            queue = self.queues[channel] = deque()
            self.order.append(channel)
        queue.append(item)
        self.pushed += 1

    def peek(self) -> T:
        return self.queues[self.order[0]][0]

    def pop(self) -> T:
        channel = self.order.popleft()
        queue = self.queues[channel]
        item = queue.popleft()
        if queue:
            self.order.append(channel)
        else:
            del self.queues[channel]
        return item


@dataclass(slots=True)
class _Control(Generic[T]):
    item: T


class ChannelTurns(Generic[T]):
    """Frames toward one peer; ``pop`` gives the next under the rules above."""

    def __init__(self, max_overtaken: int | None = None) -> None:
        if max_overtaken is not None and max_overtaken < 1:
            raise ValueError("max_overtaken must be at least 1")
        # A block of turns takes at most this many frames; the next start a new block.
        self._block_size = None if max_overtaken is None else max_overtaken + 1
        self._blocks: deque[_Turns[T] | _Control[T]] = deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, channel: int, item: T) -> None:
        blocks = self._blocks
        self._count += 1
        if channel == CONTROL_CHANNEL:
            blocks.append(_Control(item))
            return
        last = blocks[-1] if blocks else None
        if not isinstance(last, _Turns) or (self._block_size is not None and last.pushed >= self._block_size):
            last = _Turns()
            blocks.append(last)
        last.push(channel, item)

    def peek(self) -> T:
        """The frame ``pop`` would give; the queue must not be empty."""
        first = self._blocks[0]
        return first.item if isinstance(first, _Control) else first.peek()

    def pop(self) -> T:
        """The next frame; the queue must not be empty."""
        first = self._blocks[0]
        self._count -= 1
        if isinstance(first, _Control):
            self._blocks.popleft()
            return first.item
        item = first.pop()
        if not first.order:
            self._blocks.popleft()
        return item


__all__ = ["CONTROL_CHANNEL", "ChannelTurns"]
