"""OpenAI-compatible HTTP API: ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/completions``, ``/v1/chat/completions``.

Requests are validated into typed settings (:mod:`.request_fields`): every field is
honoured or refused with a 400 naming it, never silently ignored. Every error status —
refusals, 404, 405, 413, a bug's 500 — answers OpenAI's JSON error object
(:mod:`.errors`); ``--api-key`` and ``--cors-origin`` are enforced by :mod:`.auth`.
``stream: true`` answers with server-sent events ending in ``data: [DONE]``; with
``stream_options.include_usage`` every chunk says ``"usage": null`` and a last chunk with
no choices carries the usage, as OpenAI sends it. A client that disconnects cancels its
generation: the handler is cancelled (aiohttp handler cancellation) or its next write
fails, and either way the completion's token stream is closed, which cancels the work on
every hop. ``system_fingerprint`` says how the route behind a response computes (null
when the backend cannot tell): equal values mean the same contract, boundary and
per-layer numerics. A request the mesh has no room for
(:class:`~meshnode.head.backend.MeshBusy`) is a 429 with ``Retry-After`` and OpenAI's
rate-limit error object, decided before any byte of the answer: it is never queued
without bound, and a request answered 200 is never dropped for capacity. A request whose
``deadline_s`` the route's expected time cannot meet is refused before it starts (a 400,
``deadline_unreachable``: :func:`~meshnode.api.request_fields.check_deadline`).

``/health`` is readiness (200 only while a generation could start here: a complete route
for a model and not draining; else 503 with the reason); ``/livez`` (also
``/health/live``) is liveness, 200 while the process serves HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from meshnode.api.answer_log import logged_answer
from meshnode.api.auth import ApiAccess, access_middleware, add_cors_on_prepare
from meshnode.api.errors import (
    RATE_LIMIT,
    SERVICE_UNAVAILABLE,
    ApiError,
    error_body,
    openai_errors,
    track_started_answers,
)
from meshnode.api.request_fields import (
    ParsedRequest,
    check_against_model,
    check_deadline,
    check_prompt_fits,
    parse_request,
)
from meshnode.head.backend import (
    ContextLengthExceeded,
    ContextReporting,
    CoverageReporting,
    GenerationBackend,
    GenerationFailed,
    MeshBusy,
    PromptTokenizer,
    ReadinessReporting,
    RouteTimeReporting,
    UnknownModel,
)
from meshnode.head.completions import CompletionRequest, CompletionResult, TextDelta, run_completion

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
MESH_BUSY_CODE = "mesh_at_capacity"
LIVENESS_PATHS = ("/livez", "/health/live")


def busy_error(busy: MeshBusy) -> ApiError:
    """429: the mesh (or this head) has no room now; ``Retry-After`` says when to ask again."""
    return ApiError(
        str(busy),
        status=429,
        code=MESH_BUSY_CODE,
        error_type=RATE_LIMIT,
        headers={"Retry-After": str(busy.retry_after_s)},
    )


class OpenAIApi:
    def __init__(
        self,
        backend: GenerationBackend,
        *,
        extra_routes: Callable[[web.Application], None] | None = None,
        access: ApiAccess | None = None,
    ):
        self.backend = backend
        access = access or ApiAccess()
        # Outermost first: errors of the access check are OpenAI objects too.
        self.app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[openai_errors, access_middleware(access)]
        )
        add_cors_on_prepare(self.app, access)
        track_started_answers(self.app)
        self.app.router.add_get("/v1/models", self.models)
        # A model id may hold slashes ("org/name" through --model-name).
        self.app.router.add_get("/v1/models/{model:.+}", self.model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)
        for path in LIVENESS_PATHS:
            self.app.router.add_get(path, self.live)
        if extra_routes is not None:
            extra_routes(self.app)

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: the process serves HTTP (whether it can generate is /health's question)."""
        return web.json_response({"status": "alive"})

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 only when a generation could start here now, else 503 with the reason."""
        models = self.backend.model_names()
        reason = self._not_ready_reason(models)
        if reason is not None:
            return web.json_response(
                {"status": "unavailable", "reason": reason, "models": models}, status=503
            )
        return web.json_response({"status": "ok", "models": models})

    def _not_ready_reason(self, models: list[str]) -> str | None:
        if isinstance(self.backend, ReadinessReporting):
            return self.backend.not_ready_reason()
        return None if models else "no model has a complete route"

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [self._model_object(name, created) for name in self.backend.model_names()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """One model, as OpenAI's ``models.retrieve`` asks for it; 404 naming what is served."""
        name = request.match_info["model"]
        served = self.backend.model_names()
        if name not in served:
            raise ApiError(
                f"model '{name}' is not served here (available: {', '.join(served) or 'none'})",
                "model",
                status=404,
                code="model_not_found",
            )
        return web.json_response(self._model_object(name, int(time.time())))

    def _model_object(self, name: str, created: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "meshnode",
            **self._coverage(name),
        }

    def _coverage(self, model: str) -> dict[str, Any]:
        """``meshnode``: the model's layer count and ``coverage``, [start, end, replicas] per span
        (an extension field: OpenAI clients ignore what they do not know)."""
        if not isinstance(self.backend, CoverageReporting):
            return {}
        coverage = self.backend.model_coverage(model)
        if coverage is None:
            return {}
        spans = [[span.start_layer, span.end_layer, span.replicas] for span in coverage.spans]
        return {"meshnode": {"layers": coverage.total_layers, "coverage": spans}}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError("the request body is not valid JSON") from None
        except RecursionError:
            # Python's parser recurses once per level: "[[[[..." a few thousand deep stops it.
            raise ApiError("the request body nests JSON too deeply") from None
        served = self.backend.model_names()
        if not served and isinstance(body, dict) and body.get("model") is None:
            # Nothing to default to: say why, as a named model's request would (503, not a 400
            # asking for a model no name would make servable).
            raise ApiError(
                f"no model can be served here now: {self._not_ready_reason(served) or 'no complete route'}",
                status=503,
                error_type=SERVICE_UNAVAILABLE,
            )
        parsed = parse_request(body, chat=chat, served=served)
        prompt, max_tokens = await self._prompt(parsed)
        completion = CompletionRequest(parsed.model, prompt, max_tokens, parsed.sampling, parsed.stop)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        events = logged_answer(run_completion(self.backend, completion), ident, parsed.model)
        try:
            if parsed.stream:
                return await self._stream(request, events, parsed, ident, chat=chat)
            return await self._whole(events, parsed, ident, chat=chat)
        except ContextLengthExceeded as exc:
            raise ApiError(str(exc), parsed.prompt_param, code="context_length_exceeded") from None
        except MeshBusy as exc:
            log.info("generation %s refused: %s", ident, exc)
            raise busy_error(exc) from None
        except GenerationFailed as exc:
            log.warning("generation %s failed: %s", ident, exc)
            raise ApiError(str(exc), status=503, error_type=SERVICE_UNAVAILABLE) from None
        finally:
            await events.aclose()

    async def _prompt(self, parsed: ParsedRequest) -> tuple[list[int], int]:
        """The prompt's tokens and the request's max_tokens, checked against the model."""
        try:
            tokenizer = self.backend.tokenizer(parsed.model)
            context = (
                self.backend.context_tokens(parsed.model)
                if isinstance(self.backend, ContextReporting)
                else None
            )
        except UnknownModel as exc:
            raise ApiError(str(exc), "model", status=404, code="model_not_found") from None
        max_tokens = check_against_model(
            parsed, context_tokens=context, vocab_size=getattr(tokenizer, "n_vocab", None)
        )
        # Off the event loop: a 4 MiB prompt takes llama.cpp seconds to tokenize, and every
        # stream this node serves, and its QUIC connections, would wait meanwhile.
        prompt = await asyncio.to_thread(self._tokens, parsed, tokenizer)
        check_prompt_fits(len(prompt), context_tokens=context, param=parsed.prompt_param)
        if parsed.deadline_s is not None and isinstance(self.backend, RouteTimeReporting):
            route = self.backend.route_time(parsed.model)
            max_tokens = check_deadline(parsed, max_tokens, len(prompt), route)
        return prompt, max_tokens

    @staticmethod
    def _tokens(parsed: ParsedRequest, tokenizer: PromptTokenizer) -> list[int]:
        if parsed.prompt_tokens is not None:
            return parsed.prompt_tokens
        try:
            if parsed.messages is not None:
                return tokenizer.encode_chat(parsed.messages)
            assert parsed.prompt_text is not None
            return tokenizer.encode_prompt(parsed.prompt_text)
        except ValueError as exc:
            # The tokenizer's refusal, e.g. a chat template llama.cpp does not know: the model's
            # limit, not the client's mistake, but no retry helps (hence 400, not 500).
            code = "unsupported_chat_template" if parsed.messages is not None else None
            raise ApiError(
                f"{exc} (try /v1/completions with a prompt)" if code else str(exc),
                parsed.prompt_param,
                code=code,
            ) from None

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
            if parsed.include_usage:
                body["usage"] = None  # OpenAI's chunks say so until the last one carries it
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
            error = error_body(str(exc), SERVICE_UNAVAILABLE)
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
    access: ApiAccess | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the API; returns the runner (``await runner.cleanup()`` to stop) and the bound port."""
    api = OpenAIApi(backend, extra_routes=extra_routes, access=access)
    runner = web.AppRunner(api.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    # asyncio's and uvloop's servers both list their sockets; their common base does not say so.
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]  # see above
    return runner, bound
