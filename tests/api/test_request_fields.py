"""Every request field honoured or refused (400 naming it), and every error status as OpenAI's
JSON error object."""

import json

import aiohttp
import openai
import pytest
from scripted_backend import CharTokenizer, ScriptedBackend

from engines.interface import SamplingParams
from meshnode.api.openai_api import MAX_BODY_BYTES, start_api_server

CHAT = [{"role": "user", "content": "hi"}]


class ContextBackend(ScriptedBackend):
    """Knows its context and vocabulary, as the real route backend does."""

    def __init__(self, context: int | None = 64, *, reason: str | None = None) -> None:
        super().__init__("Hello")
        self.context = context
        self.reason = reason

    def context_tokens(self, model: str) -> int | None:
        self.tokenizer(model)
        return self.context

    def not_ready_reason(self) -> str | None:
        return self.reason

    def tokenizer(self, model: str) -> CharTokenizer:
        tokenizer = super().tokenizer(model)
        tokenizer.n_vocab = 1000
        return tokenizer


class TemplateRefusingTokenizer(CharTokenizer):
    def encode_chat(self, messages):
        raise ValueError("llama.cpp does not support the chat template of odd.gguf")


class TemplateRefusingBackend(ScriptedBackend):
    def tokenizer(self, model: str) -> CharTokenizer:
        super().tokenizer(model)
        return TemplateRefusingTokenizer()


class CrashingBackend(ScriptedBackend):
    def tokenizer(self, model: str) -> CharTokenizer:
        raise RuntimeError("a bug with a secret path /home/x")


@pytest.fixture
async def serve():
    runners = []

    async def start(backend) -> str:
        runner, port = await start_api_server(backend, "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def call(method: str, url: str, **kwargs) -> tuple[int, dict, aiohttp.ClientResponse]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json(), response


def assert_error(body: dict, *, type_: str, param: str | None, code: str | None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (type_, param, code)


@pytest.mark.parametrize(
    ("chat", "extra", "param", "code"),
    [
        (True, {"response_format": {"type": "xml"}}, "response_format.type", None),
        (True, {"response_format": "json"}, "response_format", None),
        (True, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
        (
            True,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "response_format.json_schema.schema",
            "unsupported_parameter",
        ),
        (False, {"response_format": {"type": "json_object"}}, "response_format", "unknown_parameter"),
        (True, {"logprobs": True}, "logprobs", "unsupported_parameter"),
        (True, {"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        (True, {"n": 2}, "n", "unsupported_parameter"),
        (
            True,
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
            "unsupported_parameter",
        ),
        (True, {"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        (False, {"echo": True}, "echo", "unsupported_parameter"),
        (False, {"best_of": 3}, "best_of", "unsupported_parameter"),
        (False, {"suffix": "end"}, "suffix", "unsupported_parameter"),
        (False, {"logprobs": 3}, "logprobs", "unsupported_parameter"),
        (True, {"temperatur": 0.5}, "temperatur", "unknown_parameter"),
        (False, {"max_completion_tokens": 5}, "max_completion_tokens", "unknown_parameter"),
        (True, {"stream_options": {"include_usage": True}}, "stream_options", None),
        (
            True,
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "unsupported_parameter",
        ),
        (
            True,
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            None,
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "unsupported_parameter",
        ),
        (True, {"presence_penalty": 2.5}, "presence_penalty", None),
        (True, {"frequency_penalty": -3}, "frequency_penalty", None),
        (True, {"repeat_penalty": 0}, "repeat_penalty", None),
        (True, {"min_p": 1.5}, "min_p", None),
        (True, {"repeat_last_n": -1}, "repeat_last_n", None),
        (True, {"logit_bias": {"12": 101}}, "logit_bias", None),
        (True, {"logit_bias": {"x": 1}}, "logit_bias", None),
        (True, {"logit_bias": {"1000": 1}}, "logit_bias", None),
        (True, {"seed": 2**64}, "seed", None),
        (True, {"user": 7}, "user", None),
        (True, {"max_tokens": 65}, "max_tokens", "context_length_exceeded"),
        (True, {"max_completion_tokens": 100}, "max_completion_tokens", "context_length_exceeded"),
        (False, {"prompt": [5, 1000]}, "prompt", None),
        (True, {"stop": "x" * 513}, "stop", None),
        (False, {"stop": ["ok", "y" * 513]}, "stop", None),
        (True, {"store": True}, "store", "unsupported_parameter"),
        (True, {"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
        (True, {"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
        (True, {"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
        (True, {"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
        (True, {"metadata": {"team": 1}}, "metadata", None),
        (True, {"metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
        (True, {"prompt_cache_key": 5}, "prompt_cache_key", None),
        (False, {"store": False}, "store", "unknown_parameter"),
        (False, {"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
        (False, {"prompt": [[5], [6]]}, "prompt", "unsupported_parameter"),
        (False, {"prompt": [[5, -1]]}, "prompt", None),
        (False, {"prompt": [5] * 65, "max_tokens": 1}, "prompt", "context_length_exceeded"),
        (False, {"prompt": "x" * 80, "max_tokens": 1}, "prompt", "context_length_exceeded"),
        (True, {"messages": [{"role": "user", "content": "x" * 80}]}, "messages", "context_length_exceeded"),
    ],
)
async def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(serve, chat, extra, param, code):
    backend = ContextBackend(context=64)
    base = await serve(backend)
    body = {"model": "tiny", **({"messages": CHAT} if chat else {"prompt": "x"}), **extra}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, answer, _ = await call("POST", base + path, json=body)
    assert status == 400
    assert_error(answer, type_="invalid_request_error", param=param, code=code)
    assert backend.calls == []


class UnroutableBackend(ContextBackend):
    """A mesh node whose model has no complete route yet: it lists no model."""

    def model_names(self) -> list[str]:
        return []


async def test_a_request_naming_no_model_while_none_is_servable_is_a_503_saying_why(serve):
    backend = UnroutableBackend(reason="no route covers layers [9, 18) of the model")
    base = await serve(backend)
    status, answer, _ = await call("POST", f"{base}/v1/completions", json={"prompt": "x"})
    assert status == 503
    assert_error(answer, type_="service_unavailable", param=None, code=None)
    assert (
        answer["error"]["message"]
        == "no model can be served here now: no route covers layers [9, 18) of the model"
    )
    assert backend.calls == []


async def test_a_request_naming_no_model_where_several_are_served_is_told_which(serve):
    backend = ContextBackend()
    backend.model_names = lambda: ["tiny", "other"]
    base = await serve(backend)
    status, answer, _ = await call("POST", f"{base}/v1/completions", json={"prompt": "x"})
    assert status == 400
    assert answer["error"]["message"] == "'model' is required: this node serves tiny, other"


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": False, "n": 1, "response_format": {"type": "text"}, "user": "u-1"},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True},
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"max_tokens": 64},
        {"store": False, "metadata": {"team": "search"}, "service_tier": "auto", "modalities": ["text"]},
        {"prompt_cache_key": "k-1", "safety_identifier": "u-1", "audio": None, "reasoning_effort": None},
    ],
)
async def test_fields_at_their_default_are_accepted(serve, extra):
    base = await serve(ContextBackend(context=64))
    status, answer, _ = await call(
        "POST", f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, **extra}
    )
    assert status == 200, answer


@pytest.mark.parametrize("prompt", ["hi", ["hi"], [104, 105], [[104, 105]]])
async def test_each_form_of_one_prompt_reaches_the_backend_as_its_tokens(serve, prompt):
    backend = ContextBackend()
    base = await serve(backend)
    status, answer, _ = await call("POST", f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert status == 200, answer
    assert backend.calls[-1][0] == [104, 105]


async def test_sampling_fields_reach_the_backend(serve):
    backend = ContextBackend()
    base = await serve(backend)
    body = {
        "model": "tiny",
        "prompt": "x",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repeat_penalty": 1.1,
        "repeat_last_n": 32,
        "logit_bias": {"72": -100, "7": 2.5},
    }
    assert (await call("POST", f"{base}/v1/completions", json=body))[0] == 200
    assert backend.calls[-1][1] == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repeat_penalty=1.1,
        penalty_last_n=32,
        logit_bias=((7, 2.5), (72, -100.0)),
    )


async def test_more_logit_biases_than_a_route_carries_are_refused(serve):
    backend = ScriptedBackend()  # no vocabulary to check ids against: only the count can refuse
    base = await serve(backend)
    body = {"model": "tiny", "prompt": "x", "logit_bias": {str(t): 1 for t in range(1025)}}
    status, answer, _ = await call("POST", f"{base}/v1/completions", json=body)
    assert status == 400 and answer["error"]["param"] == "logit_bias"
    assert "1024" in answer["error"]["message"]
    body["logit_bias"] = {str(t): 1 for t in range(1024)}
    assert (await call("POST", f"{base}/v1/completions", json=body))[0] == 200


async def test_response_format_becomes_the_tails_grammar(serve):
    from llama_cpp.llama_grammar import JSON_GBNF

    backend = ContextBackend()
    base = await serve(backend)
    body = {"model": "tiny", "messages": CHAT, "response_format": {"type": "json_object"}}
    assert (await call("POST", f"{base}/v1/chat/completions", json=body))[0] == 200
    assert backend.calls[-1][1].grammar == JSON_GBNF
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    assert (await call("POST", f"{base}/v1/chat/completions", json=body))[0] == 200
    grammar = backend.calls[-1][1].grammar
    assert "answer-kv ::=" in grammar and "root ::=" in grammar
    body["response_format"] = {"type": "text"}
    assert (await call("POST", f"{base}/v1/chat/completions", json=body))[0] == 200
    assert backend.calls[-1][1].grammar == ""


async def test_top_p_zero_is_greedy(serve):
    backend = ContextBackend()
    base = await serve(backend)
    body = {"model": "tiny", "prompt": "x", "temperature": 1.5, "top_p": 0, "seed": 3}
    assert (await call("POST", f"{base}/v1/completions", json=body))[0] == 200
    sampling = backend.calls[-1][1]
    assert sampling.greedy and sampling.top_p == 1.0


async def test_max_tokens_may_reach_the_context_and_the_default_is_cut_to_it(serve):
    backend = ContextBackend(context=64)
    base = await serve(backend)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 64}
    assert (await call("POST", f"{base}/v1/chat/completions", json=body))[0] == 200
    assert backend.calls[-1][2] == 64
    # The chat default (512) is larger than this context: the context bounds it, no refusal.
    assert (await call("POST", f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CHAT}))[
        0
    ] == 200
    assert backend.calls[-1][2] == 64
    # Above the old fixed cap of 8192 when the context allows it.
    backend.context = 32768
    body["max_tokens"] = 20000
    assert (await call("POST", f"{base}/v1/chat/completions", json=body))[0] == 200
    assert backend.calls[-1][2] == 20000


async def test_include_usage_streams_null_usage_then_a_usage_chunk_without_choices(serve):
    base = await serve(ScriptedBackend("Hey"))
    body = {"model": "tiny", "prompt": "ab", "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as r:
        raw = (await r.read()).decode()
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},  # this backend has no prefix cache
    }
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"

    body["stream_options"] = {"include_usage": False}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as r:
        raw = (await r.read()).decode()
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert all("usage" not in chunk and chunk["choices"] for chunk in chunks)


async def test_the_official_client_reads_usage_and_refusals(serve):
    base = await serve(ScriptedBackend("Hey"))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert all(chunk.usage is None for chunk in chunks[:-1])
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True)
        assert refused.value.status_code == 400
        assert refused.value.param == "logprobs"
        assert refused.value.code == "unsupported_parameter"
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/nothing-here", 404, "unknown_url"),
        ("GET", "/", 404, "unknown_url"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ],
)
async def test_http_errors_are_openai_error_objects(serve, method, path, status, code):
    base = await serve(ScriptedBackend())
    answer_status, body, response = await call(method, base + path)
    assert answer_status == status
    assert_error(body, type_="invalid_request_error", param=None, code=code)
    if status == 405:
        assert response.headers["Allow"]


async def test_a_body_over_the_limit_is_a_413_object(serve):
    base = await serve(ScriptedBackend())
    padding = "x" * (MAX_BODY_BYTES + 1)
    status, body, _ = await call("POST", f"{base}/v1/completions", json={"model": "tiny", "prompt": padding})
    assert status == 413
    assert_error(body, type_="invalid_request_error", param=None, code="request_too_large")


async def test_an_unknown_chat_template_is_a_400_object(serve):
    base = await serve(TemplateRefusingBackend())
    status, body, _ = await call(
        "POST", f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CHAT}
    )
    assert status == 400
    assert_error(body, type_="invalid_request_error", param="messages", code="unsupported_chat_template")
    assert "/v1/completions" in body["error"]["message"]


async def test_a_bug_is_a_500_object_that_keeps_its_details_to_the_log(serve, caplog):
    base = await serve(CrashingBackend())
    status, body, _ = await call("POST", f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert status == 500
    assert_error(body, type_="server_error", param=None, code=None)
    assert "/home/x" not in body["error"]["message"]
    assert "a bug with a secret path" in caplog.text


async def test_health_is_readiness_and_livez_is_liveness(serve):
    backend = ContextBackend(reason="draining: this node is shutting down")
    base = await serve(backend)
    status, body, _ = await call("GET", f"{base}/health")
    assert status == 503
    assert body == {
        "status": "unavailable",
        "reason": "draining: this node is shutting down",
        "models": ["tiny"],
    }
    for path in ("/livez", "/health/live"):
        assert (await call("GET", base + path))[:2] == (200, {"status": "alive"})
    backend.reason = None
    assert (await call("GET", f"{base}/health"))[:2] == (200, {"status": "ok", "models": ["tiny"]})


async def test_a_backend_without_readiness_is_ready_when_it_lists_a_model(serve):
    class Empty(ScriptedBackend):
        def model_names(self) -> list[str]:
            return []

    base = await serve(Empty())
    status, body, _ = await call("GET", f"{base}/health")
    assert status == 503 and body["reason"] == "no model has a complete route"


class BrokenMidStream(ScriptedBackend):
    async def generate(self, model, prompt_tokens, sampling, max_tokens):
        yield ord("H")
        raise RuntimeError("a bug after the first token")


async def test_a_bug_mid_stream_ends_the_stream_without_a_second_answer(serve, caplog):
    base = await serve(BrokenMidStream())
    body = {"model": "tiny", "prompt": "x", "stream": True}
    received = b""
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            pass  # the connection was closed mid-stream, which is the point
    assert b'"text":"H"' in received
    assert b"HTTP/1.1" not in received and b"server_error" not in received
    assert "a bug after the first token" in caplog.text
