"""The OpenAI-compatible API over a scripted backend (the real chain is tested in tests/head)."""

import asyncio
import json
import logging
import threading

import aiohttp
import openai
import pytest
from helpers.polling import eventually
from scripted_backend import FingerprintedBackend, PrefixCachedBackend, ScriptedBackend

from engines.interface import SamplingParams
from meshnode.api.openai_api import start_api_server
from meshnode.app.api_commands import describe_summary
from meshnode.head.api_client import StreamSummary, completion_request, stream_completion


@pytest.fixture
async def serve():
    runners = []

    async def start(backend):
        runner, port = await start_api_server(backend, "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def post(url, body):
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_models_and_plain_completion(serve):
    backend = ScriptedBackend()
    base = await serve(backend)
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["tiny"]
    status, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 50})
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello, mesh!"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 13,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},  # this backend cannot say: none cached
    }
    assert backend.calls[0][0] == [ord("H"), ord("i")]
    assert body["system_fingerprint"] is None  # this backend cannot say how it computes


async def test_one_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(serve):
    base = await serve(ScriptedBackend())
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/models/tiny") as response:
            assert response.status == 200
            assert {k: v for k, v in (await response.json()).items() if k != "created"} == {
                "id": "tiny",
                "object": "model",
                "owned_by": "meshnode",
            }
        async with session.get(f"{base}/v1/models/org/other") as response:
            error = (await response.json())["error"]
            assert response.status == 404
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert error["message"] == "model 'org/other' is not served here (available: tiny)"


async def test_responses_carry_the_system_fingerprint_of_the_route_at_the_time(serve):
    base = await serve(FingerprintedBackend("Hello", switch_after=3))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    status, body = await post(f"{base}/v1/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello"
    assert body["system_fingerprint"] == "fp_second"  # the route that finished the answer
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/chat/completions", json=stream) as r,
    ):
        raw = (await r.read()).decode()
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    texts = [
        (c["choices"][0]["delta"].get("content"), c["system_fingerprint"]) for c in chunks if c["choices"]
    ]
    # The role chunk and the first three characters came from the first route, the rest from the second.
    assert texts == [
        ("", "fp_first"),
        ("H", "fp_first"),
        ("e", "fp_first"),
        ("l", "fp_first"),
        ("l", "fp_second"),
        ("o", "fp_second"),
        (None, "fp_second"),
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["system_fingerprint"] == "fp_second"


async def test_length_limit_stop_strings_and_sampling_settings(serve):
    backend = ScriptedBackend()
    base = await serve(backend)
    _, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5})
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello", "length")
    _, body = await post(
        f"{base}/v1/completions",
        {
            "model": "tiny",
            "prompt": "x",
            "stop": [", m"],
            "temperature": 0,
            "top_k": 3,
            "top_p": 0.5,
            "seed": 9,
        },
    )
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello", "stop")
    assert backend.calls[-1][1] == SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=9)
    assert backend.closed.is_set()


async def test_chat_streaming_events(serve):
    base = await serve(ScriptedBackend("Hi!"))
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/chat/completions", json=body) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hi!"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_the_official_openai_client_works_unchanged(serve):
    base = await serve(ScriptedBackend("Hello there"))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    try:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0
        )
        assert reply.choices[0].message.content == "Hello there"
        assert reply.system_fingerprint is None
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "Hello there"
        completion = await client.completions.create(model="tiny", prompt="hey", max_tokens=5)
        assert completion.choices[0].text == "Hello"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
    finally:
        await client.close()


async def read_chunks(url, body):
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        raw = (await response.read()).decode()
    return [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e and e != "data: [DONE]"]


@pytest.mark.parametrize(
    ("path", "prompt"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "a long shared prefix"}),
    ],
)
async def test_usage_says_how_many_prompt_tokens_a_kept_prefix_spared(serve, path, prompt):
    base = await serve(PrefixCachedBackend("Hello", cached=16))
    status, body = await post(f"{base}{path}", {"model": "tiny", **prompt})
    assert status == 200
    usage = body["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stream = {"model": "tiny", **prompt, "stream": True, "stream_options": {"include_usage": True}}
    chunks = await read_chunks(f"{base}{path}", stream)
    # Null on every chunk but the last, which has no choices and the whole tally (OpenAI's way).
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 16}}


async def test_the_official_client_and_ours_read_the_cached_tokens(serve):
    base = await serve(PrefixCachedBackend("Hello", cached=8))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.prompt_tokens_details.cached_tokens == 8
        completion = await client.completions.create(model="tiny", prompt="hey")
        assert completion.usage.prompt_tokens_details.cached_tokens == 8
    finally:
        await client.close()
    path, body = completion_request("hey there", chat=False, max_tokens=16)
    events = [event async for event in stream_completion(base, path, body)]
    summary = events[-1]
    assert isinstance(summary, StreamSummary)
    assert (summary.text, summary.prompt_tokens, summary.cached_tokens) == ("Hello", 9, 8)
    assert "8 of 9 prompt tokens cached" in describe_summary(summary)
    # A server with nothing cached (or that does not say) reads as 0, and the line leaves it out.
    plain = await serve(ScriptedBackend("Hi"))
    events = [event async for event in stream_completion(plain, path, body)]
    assert events[-1].cached_tokens == 0 and "cached" not in describe_summary(events[-1])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
    ],
)
async def test_bad_requests_name_the_parameter(serve, body, status, param):
    base = await serve(ScriptedBackend())
    got_status, got = await post(f"{base}/v1/completions", body)
    assert got_status == status
    assert got["error"]["param"] == param


async def test_chat_validation_and_invalid_json(serve):
    base = await serve(ScriptedBackend())
    status, body = await post(f"{base}/v1/chat/completions", {"model": "tiny", "messages": []})
    assert (status, body["error"]["param"]) == (400, "messages")
    status, body = await post(f"{base}/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x"}]})
    assert (status, body["error"]["param"]) == (400, "messages[0].role")
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", data=b"{nope") as r:
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]
    deep = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", data=deep) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == "the request body nests JSON too deeply"
    status, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "x"})
    assert status == 200  # and the server goes on answering


async def test_generation_failure_is_a_503_with_the_reason(serve):
    base = await serve(ScriptedBackend(fail=True))
    status, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "x"})
    assert status == 503
    assert "no route" in body["error"]["message"]


async def test_a_failure_mid_stream_is_an_error_event_then_done(serve):
    base = await serve(ScriptedBackend("Hello", fail_after=3))
    body = {"model": "tiny", "prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "Hel"
    assert "the worker is unreachable" in json.loads(events[-2])["error"]["message"]
    status, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "x"})
    assert status == 503 and "the worker is unreachable" in body["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_prompt_beyond_the_context_is_a_400_naming_it(serve, stream):
    base = await serve(ScriptedBackend(too_long=True))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    status, got = await post(f"{base}/v1/chat/completions", body)
    assert status == 400
    assert (got["error"]["code"], got["error"]["param"]) == ("context_length_exceeded", "messages")


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_closes_the_token_stream(serve, stream):
    backend = ScriptedBackend("x" * 400, delay=0.02, eos=False)
    base = await serve(backend)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 400, "stream": stream}
    session = aiohttp.ClientSession()
    try:
        if stream:
            response = await session.post(f"{base}/v1/completions", json=body)
            await response.content.readline()
            response.close()
        else:
            # The reply only starts when the whole completion is done: hang up while waiting.
            waiting = asyncio.create_task(session.post(f"{base}/v1/completions", json=body))
            await asyncio.sleep(0.3)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
    finally:
        await session.close()
    await asyncio.wait_for(backend.closed.wait(), timeout=5)
    assert backend.tokens_sent < 400


class SlowTokenizerBackend(ScriptedBackend):
    """Its tokenizer holds the prompt "slow" until ``released`` is set, as llama.cpp holds a
    prompt of megabytes for seconds."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.entered = threading.Event()
        self.released = threading.Event()
        self.waited: list[bool] = []

    def tokenizer(self, model: str):
        plain = super().tokenizer(model)
        backend = self

        class Held(type(plain)):
            def encode_prompt(self, text: str) -> list[int]:
                if text == "slow":
                    backend.entered.set()
                    backend.waited.append(backend.released.wait(timeout=30))
                return plain.encode_prompt(text)

        return Held()


async def test_other_requests_are_served_while_a_prompt_is_tokenized(serve):
    backend = SlowTokenizerBackend()
    base = await serve(backend)
    slow = asyncio.create_task(post(f"{base}/v1/completions", {"model": "tiny", "prompt": "slow"}))
    assert await asyncio.to_thread(backend.entered.wait, 30)
    status, body = await post(f"{base}/v1/completions", {"model": "tiny", "prompt": "fast"})
    assert (status, body["choices"][0]["text"]) == (200, "ok")
    backend.released.set()
    status, body = await slow
    assert (status, body["choices"][0]["text"]) == (200, "ok")
    assert backend.waited == [True]


@pytest.mark.parametrize("stream", [False, True])
async def test_each_finished_answer_is_one_log_line_with_its_tokens(serve, caplog, stream):
    caplog.set_level(logging.INFO, logger="meshnode.api")
    base = await serve(ScriptedBackend())
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 5, "stream": stream}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()
    await eventually(lambda: any("completion tokens" in m for m in caplog.messages))
    (line,) = [m for m in caplog.messages if "completion tokens" in m]
    assert line.startswith("cmpl-") and " tiny: 2 prompt + 5 completion tokens (length) in " in line
    assert "first text after " in line
