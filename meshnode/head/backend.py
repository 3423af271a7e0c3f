"""What the HTTP API needs from a model: a tokenizer and a token stream.

The API never sees routes, shards or sessions. A backend turns a prompt into
tokens and streams generated token ids; closing the stream (``aclose``) must
cancel the generation everywhere it runs, which is how a client that hangs up
stops work on every hop. A stream may also say how the computation behind it
runs (:class:`FingerprintedStream`), which the API reports as ``system_fingerprint``, and how
much of its prompt it did not compute again (:class:`CacheReportingStream`), which the API reports
as ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol, runtime_checkable

from engines.interface import SamplingParams
from meshnode.head.coverage import ModelCoverage
from meshnode.head.route_time import RouteTime
from meshnode.wire.errors import MeshnodeError


class UnknownModel(MeshnodeError):
    def __init__(self, model: str, available: Sequence[str]) -> None:
        super().__init__(f"model {model!r} is not served here (available: {', '.join(available) or 'none'})")
        self.model = model


class GenerationFailed(MeshnodeError):
    """Generation could not run or complete (no route, every retry failed).

    The message is safe to show a client.
    """


class MeshBusy(GenerationFailed):
    """No route has room for another generation now (every replica's shards at capacity, or the
    head at its limit of concurrent generations); the client should retry after ``retry_after_s``.

    Raised only before the first token: a generation that started is never failed for capacity."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, int(retry_after_s))


class ContextLengthExceeded(GenerationFailed):
    """The prompt does not fit a session's context on the route (a client error, not a failure)."""


class IncrementalDetokenizer(Protocol):
    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly empty while a UTF-8 sequence is open)."""
        ...

    def flush(self) -> str: ...


class PromptTokenizer(Protocol):
    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def is_end_of_generation(self, token_id: int) -> bool: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


class TokenStream(Protocol):
    """Generated token ids; ``aclose`` cancels the generation everywhere it runs."""

    def __aiter__(self) -> AsyncIterator[int]: ...

    def __anext__(self) -> Awaitable[int]: ...

    def aclose(self) -> Awaitable[None]: ...


@runtime_checkable
class FingerprintedStream(Protocol):
    """A token stream that knows how its tokens are computed (optional for backends)."""

    @property
    def system_fingerprint(self) -> str | None:
        """A short id of the computing configuration; None while it is not known yet."""
        ...


@runtime_checkable
class CacheReportingStream(Protocol):
    """A token stream that knows how many prompt tokens came from a prefix cache (optional for
    backends: a stream without it reports 0)."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose computation was reused rather than run again (0 until the prompt's
        prefill has started)."""
        ...


class GenerationBackend(Protocol):
    def model_names(self) -> list[str]: ...

    def tokenizer(self, model: str) -> PromptTokenizer:
        """Raises :class:`UnknownModel`."""
        ...

    def generate(
        self, model: str, prompt_tokens: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> TokenStream:
        """Generated token ids, at most ``max_tokens``; raises :class:`GenerationFailed`."""
        ...


@runtime_checkable
class ReadinessReporting(Protocol):
    """A backend that can say why it cannot answer now (optional: else ready = some model listed)."""

    def not_ready_reason(self) -> str | None:
        """None when a generation could start now; else a reason safe to show anyone."""
        ...


@runtime_checkable
class CoverageReporting(Protocol):
    """A backend that knows which shards serve a model's layers (optional: /v1/models then
    lists the model alone)."""

    def model_coverage(self, model: str) -> ModelCoverage | None:
        """None when no shard of the mesh serves ``model`` now."""
        ...


@runtime_checkable
class ContextReporting(Protocol):
    """A backend that knows a session's context for a model (optional: else max_tokens is not
    checked against it before the generation starts)."""

    def context_tokens(self, model: str) -> int | None:
        """Raises :class:`UnknownModel`; None when not known now."""
        ...


@runtime_checkable
class RouteTimeReporting(Protocol):
    """A backend that knows what the route a request would take now is expected to take per
    token (optional: else a request's ``deadline_s`` is not checked before it starts)."""

    def route_time(self, model: str) -> RouteTime | None:
        """Raises :class:`UnknownModel`; None when no route is complete now."""
        ...
