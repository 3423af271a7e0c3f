"""OpenAI-compatible HTTP API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Requests are validated into typed settings (a bad request is a 400 with an
OpenAI-style error body naming the parameter); ``stream: true`` answers with
server-sent events ending in ``data: [DONE]``. A client that disconnects
cancels its generation: the handler is cancelled (aiohttp handler
cancellation) or its next write fails, and either way the completion's token
stream is closed, which cancels the work on every hop. ``system_fingerprint``
says how the route behind a response computes (null when the backend cannot
tell): equal values mean the same contract, boundary and per-layer numerics.
A request the mesh has no room for (:class:`~meshnode.head.backend.MeshBusy`)
is a 429 with ``Retry-After`` and OpenAI's rate-limit error object, decided
before any byte of the answer: it is never queued without bound, and a
request answered 200 is never dropped for capacity.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engines.interface import SamplingParams
from meshnode.head.backend import (
    ContextLengthExceeded,
    GenerationBackend,
    GenerationFailed,
    MeshBusy,
    UnknownModel,
)
from meshnode.head.completions import CompletionRequest, CompletionResult, TextDelta, run_completion

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512
MAX_TOKENS_LIMIT = 8192
MAX_BODY_BYTES = 4 * 1024 * 1024
UNSUPPORTED_PARAMETERS = ("logprobs", "top_logprobs", "echo", "best_of", "tools", "functions", "suffix")
CHAT_ROLES = ("system", "developer", "user", "assistant")


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_response(error: InvalidRequest, error_type: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": error.message, "type": error_type, "param": error.param, "code": error.code}}
    return web.json_response(body, status=error.status)


# OpenAI's error type for a 429; `code` says which capacity ran out here.
RATE_LIMIT_TYPE = "rate_limit_exceeded"
MESH_BUSY_CODE = "mesh_at_capacity"


def busy_response(busy: MeshBusy) -> web.Response:
    """429: the mesh (or this head) has no room now; ``Retry-After`` says when to ask again."""
    body = {"error": {"message": str(busy), "type": RATE_LIMIT_TYPE, "param": None, "code": MESH_BUSY_CODE}}
    return web.json_response(body, status=429, headers={"Retry-After": str(busy.retry_after_s)})


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    prompt_text: str | None
    prompt_tokens: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be a number between {low} and {high}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer between {low} and {high}", name)
    return value


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequest("only text content parts are supported", f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(
        "message content must be a string or a list of text parts", f"messages[{index}].content"
    )


def parse_request(body: Any, *, chat: bool, served: list[str]) -> ParsedRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is None and len(served) == 1:
        model = served[0]
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", "model")
    for name in UNSUPPORTED_PARAMETERS:
        if body.get(name) not in (None, False, 0, []):
            raise InvalidRequest(f"'{name}' is not supported", name)
    if _integer(body, "n", 1, 1, 1) != 1:
        raise InvalidRequest("only n=1 is supported", "n")

    prompt_text = prompt_tokens = messages = None
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("'messages' must be a non-empty list", "messages")
        messages = []
        for index, message in enumerate(raw):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
                raise InvalidRequest(
                    f"role must be one of {', '.join(CHAT_ROLES)}", f"messages[{index}].role"
                )
            role = "system" if message["role"] == "developer" else message["role"]
            messages.append({"role": role, "content": _content_text(message.get("content", ""), index)})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            prompt_tokens = list(prompt)
        else:
            raise InvalidRequest("'prompt' must be a string or a list of token ids", "prompt")

    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _integer(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", default_max, 1, MAX_TOKENS_LIMIT)
    assert max_tokens is not None

    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InvalidRequest("'stop' must be a string or a list of up to 4 strings", "stop")

    seed = _integer(body, "seed", None, -(2**63), 2**64 - 1)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0, 1_000_000) or 0,
        seed=(seed if seed is not None else int.from_bytes(os.urandom(8), "little")) % 2**64,
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    return ParsedRequest(
        model=model,
        prompt_text=prompt_text,
        prompt_tokens=prompt_tokens,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


class OpenAIApi:
    def __init__(
        self, backend: GenerationBackend, *, extra_routes: Callable[[web.Application], None] | None = None
    ):
        self.backend = backend
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)
        if extra_routes is not None:
            extra_routes(self.app)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": self.backend.model_names()})

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "meshnode"}
            for name in self.backend.model_names()
        ]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise InvalidRequest("the request body is not valid JSON") from None
            parsed = parse_request(body, chat=chat, served=self.backend.model_names())
            try:
                tokenizer = self.backend.tokenizer(parsed.model)
            except UnknownModel as exc:
                raise InvalidRequest(str(exc), "model", status=404, code="model_not_found") from None
            if parsed.messages is not None:
                prompt = tokenizer.encode_chat(parsed.messages)
            elif parsed.prompt_text is not None:
                prompt = tokenizer.encode_prompt(parsed.prompt_text)
            else:
                assert parsed.prompt_tokens is not None
                prompt = parsed.prompt_tokens
        except InvalidRequest as exc:
            return error_response(exc)
        completion = CompletionRequest(parsed.model, prompt, parsed.max_tokens, parsed.sampling, parsed.stop)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        events = run_completion(self.backend, completion)
        try:
            if parsed.stream:
                return await self._stream(request, events, parsed, ident, chat=chat)
            return await self._whole(events, parsed, ident, chat=chat)
        except ContextLengthExceeded as exc:
            error = InvalidRequest(str(exc), "messages" if chat else "prompt", code="context_length_exceeded")
            return error_response(error)
        except MeshBusy as exc:
            log.info("generation %s refused: %s", ident, exc)
            return busy_response(exc)
        except GenerationFailed as exc:
            log.warning("generation %s failed: %s", ident, exc)
            return error_response(InvalidRequest(str(exc), status=503), "service_unavailable")
        finally:
            await events.aclose()

    async def _whole(
        self,
        events: AsyncIterator[TextDelta | CompletionResult],
        parsed: ParsedRequest,
        ident: str,
        *,
        chat: bool,
    ) -> web.Response:
        result: CompletionResult | None = None
        async for event in events:
            if isinstance(event, CompletionResult):
                result = event
        assert result is not None
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": result.text,
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
        body = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": parsed.model,
            "system_fingerprint": result.system_fingerprint,
            "choices": [choice],
            "usage": result.usage,
        }
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        events: AsyncIterator[TextDelta | CompletionResult],
        parsed: ParsedRequest,
        ident: str,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(event: TextDelta | CompletionResult, choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": parsed.model,
                # Per chunk, as OpenAI sends it: a re-route mid-stream changes it from there on.
                "system_fingerprint": event.system_fingerprint,
                "choices": choices,
            }
            body.update(extra)
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        def choice(text: str | None, finish_reason: str | None, *, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

        # The first event decides the status: a failure before any token is a
        # proper 503, not an event stream that breaks off.
        first_event = await anext(events)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        if chat:
            await response.write(chunk(first_event, [choice("", None, first=True)]))
        pending: list[TextDelta | CompletionResult] = [first_event]
        try:
            async for event in _chain(pending, events):
                if isinstance(event, TextDelta):
                    await response.write(chunk(event, [choice(event.text, None)]))
                else:
                    await response.write(chunk(event, [choice(None if chat else "", event.finish_reason)]))
                    if parsed.include_usage:
                        await response.write(chunk(event, [], usage=event.usage))
        except GenerationFailed as exc:
            # The status line is long gone: say it in the stream, as OpenAI's API does.
            log.warning("generation %s failed mid-stream: %s", ident, exc)
            error = {
                "error": {"message": str(exc), "type": "service_unavailable", "param": None, "code": None}
            }
            await response.write(b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _chain(
    first: list[TextDelta | CompletionResult], rest: AsyncIterator[TextDelta | CompletionResult]
) -> AsyncIterator[TextDelta | CompletionResult]:
    for event in first:
        yield event
    async for event in rest:
        yield event


async def start_api_server(
    backend: GenerationBackend,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    extra_routes: Callable[[web.Application], None] | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the API; returns the runner (``await runner.cleanup()`` to stop) and the bound port."""
    api = OpenAIApi(backend, extra_routes=extra_routes)
    runner = web.AppRunner(api.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
