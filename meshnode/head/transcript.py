"""The tokens of one generation and how to rebuild a route's caches from them. Pure.

A replay repeats the units the route originally ran, with the same boundaries:
the prompt as one prefill (chunked by the same negotiated limits), then each
generated token but the last as its own decode step at its own position. A
batched re-prefill of generated tokens is cheaper, but llama.cpp's batched and
single-token kernels round differently, so the rebuilt cache — and every token
after it — would drift from what an unbroken run produces. Decode steps whose
inputs are known need no round trip between them: they are submitted together
and pipelined within the session's credit.

After the replay the caches hold positions ``0 .. n-1`` for the ``n`` tokens
before the last generated one, and decoding continues by feeding that token at
its position: the output is identical to a run that never failed (the tail's
sampler draws with ``sample_index`` = the position it samples, so even a seeded
temperature sample repeats).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReplayStep:
    token: int
    position: int
    # The token the original run sampled here; a replay that samples another one
    # computes differently (another backend, a changed recipe) and is reported.
    expected: int


@dataclass
class Transcript:
    prompt: tuple[int, ...]
    generated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a generation needs at least one prompt token")

    @property
    def started(self) -> bool:
        return bool(self.generated)

    def next_input(self) -> tuple[int, int]:
        """The token to feed next and its position (after the first token was sampled)."""
        return self.generated[-1], len(self.prompt) + len(self.generated) - 1

    def record(self, token: int) -> None:
        self.generated.append(token)

    def replay_steps(self) -> list[ReplayStep]:
        """Decode steps that follow the prompt's prefill in a replay (none before the first token)."""
        base = len(self.prompt)
        return [
            ReplayStep(token, base + index, self.generated[index + 1])
            for index, token in enumerate(self.generated[:-1])
        ]


__all__ = ["ReplayStep", "Transcript"]
