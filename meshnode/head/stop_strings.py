"""Stop-string detection over streamed text, pure.

Text arrives in deltas; a stop string may straddle deltas. The matcher holds
back just the suffix that could still become a stop string, so a client never
sees text that a later delta reveals to be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatcher:
    stops: tuple[str, ...]
    _pending: str = ""
    stopped: bool = False

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)

    def feed(self, delta: str) -> str:
        """Text that is safe to emit now. After a match, ``stopped`` is true and
        everything from the stop string on is dropped."""
        if self.stopped:
            return ""
        text = self._pending + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = self._longest_partial_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text, once the stream ended without a match."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _longest_partial_suffix(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
