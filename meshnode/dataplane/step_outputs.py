"""What a shard session returns for a unit and for a prefill: the result tensors, read on demand (pure).

:class:`StepOutput` wraps the client's :class:`~meshnode.dataplane.client_events.UnitDone` and
decodes (and checksum-verifies) its tensors on first access: the tail's token or tokens, its
logits when the route asked for them, or a non-tail route end's hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshnode.dataplane.client_events import UnitDone
from meshnode.dataplane.payload import HIDDEN_STATES, LOGITS, TOKEN_IDS
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import WireTensor


class StepOutput:
    """What the worker (through its route) returned for one unit."""

    __slots__ = ("_tensors", "done")

    def __init__(self, done: UnitDone) -> None:
        self.done = done
        self._tensors: dict[str, WireTensor] | None = None

    @property
    def step(self) -> int:
        return self.done.step

    @property
    def work_id(self) -> str:
        return self.done.work_id

    @property
    def duplicate(self) -> bool:
        """The worker had already applied this step and answered from its replay record."""
        return self.done.duplicate

    @property
    def cache_result(self) -> shard.CacheResult:
        return self.done.cache_result

    @property
    def tensors(self) -> dict[str, WireTensor]:
        """The result tensors, decoded and checksum-verified on first access."""
        if self._tensors is None:
            self._tensors = self.done.tensors()
        return self._tensors

    @property
    def token(self) -> int | None:
        """The tail's sampled token (None for a non-final prefill chunk or a hidden-state hop); for a
        verify step, its choice after the last position."""
        tensor = self.tensors.get(TOKEN_IDS)
        return None if tensor is None else int(tensor.array[-1])

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token the tail returned: one, or for a verify step its choice after each position."""
        tensor = self.tensors.get(TOKEN_IDS)
        return () if tensor is None else tuple(int(t) for t in tensor.array.tolist())

    @property
    def logits(self) -> np.ndarray | None:
        """The tail's last-position logits, when the route asked for them."""
        tensor = self.tensors.get(LOGITS)
        return None if tensor is None else tensor.as_float32()

    @property
    def hidden(self) -> np.ndarray | None:
        """A non-tail route end's hidden states, float32 ``[n, hidden]``."""
        tensor = self.tensors.get(HIDDEN_STATES)
        return None if tensor is None else tensor.as_float32()


@dataclass(frozen=True)
class PrefillOutput:
    chunks: list[StepOutput]

    @property
    def token(self) -> int | None:
        return self.chunks[-1].token

    @property
    def logits(self) -> np.ndarray | None:
        return self.chunks[-1].logits

    @property
    def hidden(self) -> np.ndarray | None:
        parts: list[np.ndarray] = []
        for chunk in self.chunks:
            hidden = chunk.hidden
            if hidden is None:
                return None
            parts.append(hidden)
        return np.concatenate(parts)


__all__ = ["PrefillOutput", "StepOutput"]
