"""One completion: tokens in, text deltas and a final tally out.

Turns a backend's token stream into what an OpenAI-style client expects:
incremental UTF-8-safe text, stop strings honoured (and generation stopped
early), end-of-generation tokens, ``max_tokens`` and usage counts. The token
stream is always closed when the completion ends for any reason — including
the consumer going away — so the backend cancels its work. Each event carries
the stream's ``system_fingerprint`` as it stood then (a re-route may change it); the final
tally says how many prompt tokens came from the route's prefix cache (``cached_tokens``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from engines.interface import SamplingParams
from meshnode.head.backend import CacheReportingStream, FingerprintedStream, GenerationBackend
from meshnode.head.stop_strings import StopMatcher


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt_tokens: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    text: str
    system_fingerprint: str | None = None


@dataclass(frozen=True)
class CompletionResult:
    text: str
    # "stop" (end-of-generation token or stop string) or "length" (max_tokens).
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    system_fingerprint: str | None = None
    # Prompt tokens the route did not prefill again: they came from a prefix it kept.
    cached_tokens: int = 0

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` is always there, 0
        without a cache hit, as OpenAI reports it."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


async def run_completion(
    backend: GenerationBackend, request: CompletionRequest
) -> AsyncGenerator[TextDelta | CompletionResult, None]:
    """Yields text deltas, then exactly one :class:`CompletionResult`."""
    tokenizer = backend.tokenizer(request.model)
    detokenizer = tokenizer.detokenizer()
    matcher = StopMatcher(request.stop)
    pieces: list[str] = []
    generated = 0
    finish_reason = "length"
    tokens = backend.generate(request.model, request.prompt_tokens, request.sampling, request.max_tokens)

    # Checked once: a runtime Protocol check reads the property, and this runs for every token.
    fingerprinted = tokens if isinstance(tokens, FingerprintedStream) else None

    def fingerprint() -> str | None:
        return fingerprinted.system_fingerprint if fingerprinted is not None else None

    try:
        async for token_id in tokens:
            generated += 1
            if tokenizer.is_end_of_generation(token_id):
                finish_reason = "stop"
                break
            text = matcher.feed(detokenizer.feed(token_id))
            if text:
                pieces.append(text)
                yield TextDelta(text, fingerprint())
            if matcher.stopped:
                finish_reason = "stop"
                break
    finally:
        await tokens.aclose()
    if not matcher.stopped:
        tail = matcher.feed(detokenizer.flush()) + matcher.flush()
        if matcher.stopped:
            finish_reason = "stop"
        if tail:
            pieces.append(tail)
            yield TextDelta(tail, fingerprint())
    # Read once the stream is over: the prefill that decides it has run by then.
    cached = tokens.cached_tokens if isinstance(tokens, CacheReportingStream) else 0
    yield CompletionResult(
        "".join(pieces), finish_reason, len(request.prompt_tokens), generated, fingerprint(), cached
    )
