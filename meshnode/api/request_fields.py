"""Every field of a completion request, honoured or refused: never silently ignored.

A field the node cannot honour is a 400 with OpenAI's error object naming it
(``param``): ``unsupported_parameter`` for a known OpenAI field set to a value
this node cannot act on (``logprobs: true``, ``tools``, ``n: 2``),
``unknown_parameter`` for a field OpenAI does not define either (a typo must not
pass unnoticed). Fields that only restate the default (``logprobs: false``,
``n: 1``, ``response_format: text``) are accepted.

``response_format`` ``json_object`` / ``json_schema`` become a GBNF grammar the
tail's sampler follows (llama.cpp's grammar sampler; the schema through
llama-cpp-python's converter, refused when it cannot express it).

Sampling follows llama.cpp's names and meanings where OpenAI has none:
``top_k``, ``min_p``, ``repeat_penalty`` and ``repeat_last_n`` (the window the
three penalties look back on, prompt included, as llama-server counts it).
``top_p: 0`` keeps only the most likely token: it is greedy decoding, whatever
the temperature.

``deadline_s`` (a meshnode field) is the time the client will wait for the whole answer, in
seconds from the request. The head checks it against the time its route is expected to take
(:mod:`meshnode.head.route_time`: the prompt's prefill, then a decode step per token, from the
speeds the route's hops announce): a request that set ``max_tokens`` beyond what fits is refused
with a 400, code ``deadline_unreachable``, naming the tokens that fit, before any node computes
for it; one that left ``max_tokens`` at its default has it cut to what fits (``finish_reason:
length`` if it gets there). A route whose hops do not all announce a speed is not judged. A
generation running late is not cut at the deadline by the server: a client that gives up closes
the connection, which cancels the work on every hop.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from engines.interface import SamplingParams
from engines.json_grammar import json_grammar
from engines.request_limits import DEFAULT_PENALTY_LAST_N, MAX_GRAMMAR_BYTES, MAX_PENALTY_LAST_N
from meshnode.api.errors import ApiError
from meshnode.dataplane.route import MAX_LOGIT_BIASES
from meshnode.head.route_time import RouteTime

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512
# The bound before the model's context is known; the context then bounds it again.
MAX_TOKENS_LIMIT = 1 << 24
# The longest ``deadline_s`` a request may give (a day): longer says nothing a client means.
MAX_DEADLINE_S = 86_400.0
DEADLINE_UNREACHABLE = "deadline_unreachable"
CHAT_ROLES = ("system", "developer", "user", "assistant")
# OpenAI's bias range; -100 effectively bans a token, 100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0
MAX_STOP_STRINGS = 4
# The head matches stop strings against each token's text on its event loop, looking back up to
# a stop string's length: longer ones would cost every stream there time (0.8 ms a token at
# worst for four of 512, 48 ms for one of 20,000).
MAX_STOP_CHARS = 512

UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"

# Fields read below, per endpoint. Anything else in a body is refused as unknown.
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "repeat_last_n",
        "logit_bias",
    }
)
COMMON_FIELDS = SAMPLING_FIELDS | {
    "model",
    "max_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "user",
    "deadline_s",
}
# Chat fields of OpenAI's that this node honours only where they ask for nothing it lacks:
# name -> (the values that ask for nothing more than it does, what a client asks for otherwise).
CHAT_FIELDS_AT_DEFAULT: dict[str, tuple[tuple[object, ...], str]] = {
    "store": ((None, False), "(storing completions)"),
    "service_tier": ((None, "auto", "default"), "other than auto or default"),
    "modalities": ((None, ["text"]), "other than text"),
    "audio": ((None,), "(audio output)"),
    "prediction": ((None,), "(predicted outputs)"),
    "reasoning_effort": ((None,), "(reasoning models)"),
    "verbosity": ((None,), "(reasoning models)"),
    "web_search_options": ((None,), "(web search)"),
}
# Labels that change nothing in the answer: a client's cache hint and end-user id, like ``user``.
CHAT_LABEL_FIELDS = ("prompt_cache_key", "safety_identifier")
MAX_METADATA_ENTRIES = 16
CHAT_FIELDS = (
    COMMON_FIELDS
    | {
        "messages",
        "max_completion_tokens",
        "response_format",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "metadata",
        *CHAT_LABEL_FIELDS,
    }
    | CHAT_FIELDS_AT_DEFAULT.keys()
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    prompt_text: str | None
    prompt_tokens: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    # The field the client bounded it with; None for the default (cut to the context, not refused).
    max_tokens_param: str | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # Seconds the client waits for the whole answer (``deadline_s``); None: it did not say.
    deadline_s: float | None = None

    @property
    def prompt_param(self) -> str:
        """The field an error about the prompt names: ``messages`` for a chat, else ``prompt``."""
        return "messages" if self.messages is not None else "prompt"


def _unsupported(name: str, what: str) -> ApiError:
    return ApiError(f"'{name}' {what} is not supported by this server", name, code=UNSUPPORTED)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(f"'{name}' must be a number between {low} and {high}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(f"'{name}' must be an integer between {low} and {high}", name)
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
                raise ApiError(
                    "only text content parts are supported", f"messages[{index}].content", code=UNSUPPORTED
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError("message content must be a string or a list of text parts", f"messages[{index}].content")


def _check_metadata(metadata: Any) -> None:
    """OpenAI's labels for a stored completion (this node stores none): only their shape is checked."""
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_ENTRIES
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise ApiError(f"'metadata' must map at most {MAX_METADATA_ENTRIES} strings to strings", "metadata")


def _refuse_unhonoured(body: dict[str, Any], *, chat: bool) -> None:
    """Known OpenAI fields that this node honours only at their default."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in allowed:
            raise ApiError(f"Unrecognized request argument supplied: {name}", name, code=UNKNOWN)
    if body.get("logprobs") not in (None, False, 0):
        raise _unsupported("logprobs", "(token log probabilities)")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "(token log probabilities)")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo", "(echoing the prompt)")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "above 1")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix", "(insertion)")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _unsupported(name, "(tool calling)")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name, "(tool calling)")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise ApiError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    for name, (accepted, what) in CHAT_FIELDS_AT_DEFAULT.items():
        if name in body and body[name] not in accepted:
            raise _unsupported(name, what)
    for name in ("user", *CHAT_LABEL_FIELDS):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(f"'{name}' must be a string", name)
    _check_metadata(body.get("metadata"))
    if _integer(body, "n", 1, 1, 128) != 1:
        raise _unsupported("n", "above 1")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("'messages' must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ApiError(f"role must be one of {', '.join(CHAT_ROLES)}", f"messages[{index}].role")
        for key in message:
            if key not in ("role", "content", "name"):
                raise ApiError(
                    f"message field '{key}' is not supported", f"messages[{index}].{key}", code=UNSUPPORTED
                )
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append({"role": role, "content": _content_text(message.get("content", ""), index)})
    return messages


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(
            f"{len(prompt)} prompts in one request are not supported by this server: send one request "
            "per prompt (they run at the same time)",
            "prompt",
            code=UNSUPPORTED,
        )
    if isinstance(prompt, str):
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return None, list(prompt)
    raise ApiError("'prompt' must be a string or a list of token ids", "prompt")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (
        isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) for s in stop)
    ):
        raise ApiError(f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stop)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ApiError("'logit_bias' must map token ids to biases", "logit_bias")
    if len(raw) > MAX_LOGIT_BIASES:
        # The biases travel to the tail in the route, which refuses more.
        raise ApiError(f"'logit_bias' may bias at most {MAX_LOGIT_BIASES} tokens", "logit_bias")
    biases: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if (
            token < 0
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT
        ):
            raise ApiError(
                f"logit_bias maps token ids >= 0 to numbers between -{LOGIT_BIAS_LIMIT:g} and "
                f"{LOGIT_BIAS_LIMIT:g}",
                "logit_bias",
            )
        biases[token] = float(value)
    return tuple(sorted(biases.items()))


def _sampling(body: dict[str, Any]) -> SamplingParams:
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
    ):
        raise ApiError("'seed' must be a 64-bit integer", "seed")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    repeat_penalty = _number(body, "repeat_penalty", 1.0, 0.0, 100.0)
    if repeat_penalty <= 0.0:
        # llama.cpp divides positive logits by it; 1.0 is off.
        raise ApiError("'repeat_penalty' must be above 0 (1.0 disables it)", "repeat_penalty")
    return SamplingParams(
        # top_p 0 keeps only the most likely token: greedy, and said so rather than sampled.
        temperature=0.0 if top_p == 0.0 else temperature,
        top_p=1.0 if top_p == 0.0 else top_p,
        top_k=_integer(body, "top_k", 0, 0, 1_000_000),
        seed=(seed if seed is not None else int.from_bytes(os.urandom(8), "little")) % 2**64,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=repeat_penalty,
        penalty_last_n=_integer(body, "repeat_last_n", DEFAULT_PENALTY_LAST_N, 0, MAX_PENALTY_LAST_N),
        logit_bias=_logit_bias(body),
        grammar=_grammar(body),
    )


def _grammar(body: dict[str, Any]) -> str:
    """The GBNF grammar ``response_format`` asks for: none for ``text``, any JSON object for
    ``json_object``, text valid against the schema for ``json_schema``."""
    response_format = body.get("response_format")
    if response_format is None:
        return ""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ApiError("'response_format' must be an object with a 'type'", "response_format")
    kind = response_format["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_grammar()
    if kind != "json_schema":
        raise ApiError(
            f"response_format type {kind!r} is not one of text, json_object, json_schema",
            "response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError(
            "'response_format.json_schema' must be an object with a 'name'", "response_format.json_schema"
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(
            "'response_format.json_schema.schema' must be an object", "response_format.json_schema.schema"
        )
    try:
        grammar = json_grammar(schema)
    except ValueError as exc:
        raise ApiError(
            f"this JSON schema cannot be turned into a grammar: {exc}",
            "response_format.json_schema.schema",
            code=UNSUPPORTED,
        ) from None
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError("this JSON schema makes too large a grammar", "response_format.json_schema.schema")
    return grammar


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """``include_usage``; the options are refused on a request that does not stream, as OpenAI does."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    for key in options:
        if key != "include_usage":
            raise ApiError(
                f"'stream_options.{key}' is not supported", f"stream_options.{key}", code=UNSUPPORTED
            )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    return include


def parse_request(body: Any, *, chat: bool, served: list[str]) -> ParsedRequest:
    """Raises :class:`~meshnode.api.errors.ApiError` (400) naming the first field it refuses."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _refuse_unhonoured(body, chat=chat)
    model = body.get("model")
    if model is None and len(served) == 1:
        model = served[0]
    if not isinstance(model, str) or not model:
        raise ApiError(f"'model' is required: this node serves {', '.join(served) or 'none yet'}", "model")
    prompt_text = prompt_tokens = messages = None
    if chat:
        messages = _messages(body)
    else:
        prompt_text, prompt_tokens = _prompt(body)
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _integer(body, limit_name, default_max, 1, MAX_TOKENS_LIMIT)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", "stream")
    return ParsedRequest(
        model=model,
        prompt_text=prompt_text,
        prompt_tokens=prompt_tokens,
        messages=messages,
        max_tokens=max_tokens,
        max_tokens_param=limit_name if body.get(limit_name) is not None else None,
        sampling=_sampling(body),
        stop=_stops(body),
        stream=stream,
        include_usage=_stream_options(body, stream),
        deadline_s=_deadline(body),
    )


def _deadline(body: dict[str, Any]) -> float | None:
    value = body.get("deadline_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_DEADLINE_S:
        raise ApiError(
            f"'deadline_s' must be a number of seconds above 0 and at most {MAX_DEADLINE_S:g}", "deadline_s"
        )
    return float(value)


def check_against_model(parsed: ParsedRequest, *, context_tokens: int | None, vocab_size: int | None) -> int:
    """The request's ``max_tokens`` once the model's limits are known; refuses what exceeds them.

    ``max_tokens`` may be as large as a session's context (generation then ends where the
    context is full, with ``finish_reason: length``); above it the request can never be met."""
    if vocab_size is not None:
        for token, _ in parsed.sampling.logit_bias:
            if token >= vocab_size:
                raise ApiError(
                    f"logit_bias token {token} is outside the vocabulary [0, {vocab_size})", "logit_bias"
                )
        if parsed.prompt_tokens is not None and max(parsed.prompt_tokens) >= vocab_size:
            raise ApiError(f"prompt token ids must be below the vocabulary size {vocab_size}", "prompt")
    if context_tokens is None or parsed.max_tokens <= context_tokens:
        return parsed.max_tokens
    if parsed.max_tokens_param is None:
        return context_tokens
    raise ApiError(
        f"{parsed.max_tokens_param} is too large: {parsed.max_tokens}. This model's context holds at "
        f"most {context_tokens} tokens per request",
        parsed.max_tokens_param,
        code="context_length_exceeded",
    )


def check_prompt_fits(prompt_length: int, *, context_tokens: int | None, param: str) -> None:
    """Refuses a prompt longer than a session's context before any node computes a chunk of
    it: found on the route instead, it is found only after the context's worth of prefill."""
    if context_tokens is not None and prompt_length > context_tokens:
        raise ApiError(
            f"This model's context holds at most {context_tokens} tokens per request; the prompt "
            f"has {prompt_length}",
            param,
            code="context_length_exceeded",
        )


def check_deadline(
    parsed: ParsedRequest, max_tokens: int, prompt_length: int, route: RouteTime | None
) -> int:
    """The request's ``max_tokens`` once its ``deadline_s`` is held against the route's expected
    time: as it was when the request set no deadline or the route's time is unknown; cut to what
    fits when the client left it at its default; else refused (400, ``deadline_unreachable``)
    when the answer is expected to take longer than the deadline."""
    if parsed.deadline_s is None or route is None:
        return max_tokens
    budget_ms = parsed.deadline_s * 1_000
    fits = route.tokens_within(budget_ms, prompt_length)
    expected_ms = route.answer_ms(prompt_length, max_tokens)
    if fits is None or expected_ms is None or expected_ms <= budget_ms:
        return max_tokens
    if fits >= 1 and parsed.max_tokens_param is None:
        return fits
    step_ms = route.decode_ms_per_token
    assert step_ms is not None  # a known answer time has a known step
    prefill_s = prompt_length * route.prefill_ms_per_token / 1_000
    wanted = f"{parsed.max_tokens_param} {max_tokens}" if parsed.max_tokens_param else f"{max_tokens} tokens"
    advice = (
        f"ask for at most {fits} tokens or allow more time"
        if fits >= 1
        else f"not even the prompt's prefill ({prefill_s:.1f} s) and one token fit: allow more time"
    )
    # Rounded up: an answer 1.04 s long against a 1 s deadline must not read "1.0 s".
    raise ApiError(
        f"the answer is expected to take {math.ceil(expected_ms / 100) / 10:.1f} s on the route the mesh "
        f"would use ({wanted} at {step_ms:.1f} ms each, after {prefill_s:.1f} s of prefill for "
        f"{prompt_length} prompt tokens), over 'deadline_s' {parsed.deadline_s:g}: {advice}",
        "deadline_s",
        code=DEADLINE_UNREACHABLE,
    )


__all__ = [
    "DEADLINE_UNREACHABLE",
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ParsedRequest",
    "check_against_model",
    "check_deadline",
    "check_prompt_fits",
    "parse_request",
]
