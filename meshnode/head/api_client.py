"""A small streaming client for the node's OpenAI-compatible API (``meshnode generate``, the demo).

It speaks exactly what any OpenAI client sends: a chat or text completion with
``stream: true`` and ``stream_options.include_usage``, read as server-sent
events. Timing is measured here, where the user sees the text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp


class ApiError(Exception):
    """The API refused the request or could not be reached; the message is one line, ``status``
    the HTTP status of a refusal (None where no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class StreamSummary:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # Seconds from sending the request to the first text, and to the end of the stream.
    time_to_first_token_s: float
    total_s: float
    # The message of an error event the server sent after the stream began (it ended the answer).
    error: str | None = None
    # Prompt tokens the server did not compute again (``usage.prompt_tokens_details.cached_tokens``;
    # 0 from a server that does not say).
    cached_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first arrived."""
        span = self.total_s - self.time_to_first_token_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else 0.0


def completion_request(
    prompt: str,
    *,
    chat: bool,
    max_tokens: int,
    model: str | None = None,
    system: str | None = None,
    **sampling: Any,
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of a streamed completion (sampling keys left out when None)."""
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({key: value for key, value in sampling.items() if value is not None})
    if model:
        body["model"] = model
    if chat:
        messages = [{"role": "system", "content": system}] if system else []
        body["messages"] = [*messages, {"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def stream_completion(
    base_url: str, path: str, body: dict[str, Any], *, timeout_s: float = 600.0, api_key: str | None = None
) -> AsyncIterator[TextChunk | StreamSummary]:
    """Text as it arrives, then one :class:`StreamSummary`. ``timeout_s`` bounds a silence (no
    byte for that long, the wait for the first token included), not the whole stream: a long
    answer from a slow mesh (an 8B model on small machines decodes a few tokens a second) keeps
    streaming for as long as it takes."""
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    finish: str | None = None
    usage: dict[str, Any] = {}
    error: str | None = None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(base_url.rstrip("/") + path, json=body, headers=auth_headers(api_key)) as response,
        ):
            if response.status != 200:
                raise ApiError(await _error_text(response), response.status)
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if isinstance(event.get("error"), dict):
                    # Past the status line a failure can only be said in the stream (OpenAI's way).
                    error = str(event["error"].get("message") or "the generation failed")
                    continue
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
                    if text:
                        if first is None:
                            first = time.perf_counter() - started
                        pieces.append(text)
                        yield TextChunk(text)
    except aiohttp.ClientConnectorError:
        raise ApiError(f"no API answers at {base_url}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(f"the API at {base_url} failed: {exc or type(exc).__name__}") from None
    total = time.perf_counter() - started
    yield StreamSummary(
        text="".join(pieces),
        finish_reason=finish,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        time_to_first_token_s=first if first is not None else total,
        total_s=total,
        error=error,
        cached_tokens=cached_tokens(usage),
    )


def cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens``, as OpenAI reports it (0 where absent or null)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def _error_text(response: aiohttp.ClientResponse) -> str:
    try:
        body = await response.json(content_type=None)
        return f"{response.status}: {body['error']['message']}"
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        return f"{response.status}: {response.reason}"


async def served_models(base_url: str, *, timeout_s: float = 5.0, api_key: str | None = None) -> list[str]:
    """The model ids ``/v1/models`` lists (those with a complete route right now)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key)) as response,
        ):
            body = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ApiError(f"no API answers at {base_url}: {exc or type(exc).__name__}") from None
    return [str(model["id"]) for model in body.get("data", [])]


__all__ = [
    "ApiError",
    "StreamSummary",
    "TextChunk",
    "cached_tokens",
    "completion_request",
    "served_models",
    "stream_completion",
]
