"""One log line per answered request: what an operator reads to see the API at work.

Refusals and failures are logged where they are decided; this is the line for an answer that
finished (``stop`` or ``length``), with its token counts and times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

from meshnode.head.completions import CompletionResult, TextDelta

log = logging.getLogger(__name__)


async def logged_answer(
    events: AsyncGenerator[TextDelta | CompletionResult, None], ident: str, model: str
) -> AsyncGenerator[TextDelta | CompletionResult, None]:
    """``events`` unchanged; once its result has passed, a line saying how the answer went."""
    started = time.monotonic()
    first_text: float | None = None
    result: CompletionResult | None = None
    try:
        async for event in events:
            if isinstance(event, CompletionResult):
                result = event
            elif first_text is None and event.text:
                first_text = time.monotonic() - started
            yield event
    finally:
        await events.aclose()
        if result is not None:
            log.info(
                "%s %s: %d prompt + %d completion tokens (%s) in %.2f s, first text after %s",
                ident,
                model,
                result.prompt_tokens,
                result.completion_tokens,
                result.finish_reason,
                time.monotonic() - started,
                "-" if first_text is None else f"{first_text:.2f} s",
            )


__all__ = ["logged_answer"]
