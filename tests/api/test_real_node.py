"""The honest API on a real node: ``meshnode serve`` with the tiny model, a key from the
environment, and the official ``openai`` client. The penalties are checked against a reference
that applies llama.cpp's arithmetic to the engine's own logits, step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers.serve_process import serving_process

from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import ensure_tiny_model
from engines.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEY = "sk-real-node-key"
CONTEXT = 512
PROMPT = "hello world, the mesh"
TOKENS = 24


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving_process(log, tiny_model, env=os.environ | {"MESHNODE_API_KEY": KEY}, ctx=CONTEXT) as (
        url,
        _,
    ):
        yield url, log
    assert KEY not in log.read_text()


@pytest.fixture
def client(node: tuple[str, Path]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{node[0]}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def penalized_reference(model: Path, *, repeat: float, frequency: float, presence: float, last_n: int) -> str:
    """Greedy text with llama.cpp's penalties applied here, to the engine's logits, over the
    last ``last_n`` tokens of prompt and generation (what llama-server counts)."""
    tokenizer = Tokenizer.open(model)
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), 0, None, n_ctx=CONTEXT, n_seq_max=1, n_threads=1))
    sequence = tokenizer.encode_prompt(PROMPT)
    key = SessionKey("reference", 1)
    step = StepRequest(key, 0, token_ids=tuple(sequence), sampling=GREEDY, want_logits=True)
    result = engine.prefill(step)
    generated: list[int] = []
    while True:
        assert result.logits is not None
        logits = result.logits.astype(np.float32)
        for token, count in Counter(sequence[-last_n:]).items():
            value = logits[token]
            value = value * np.float32(repeat) if value <= 0 else value / np.float32(repeat)
            logits[token] = value - np.float32(count * frequency + presence)
        choice = int(np.argmax(logits))
        generated.append(choice)
        sequence.append(choice)
        if len(generated) == TOKENS or tokenizer.is_end_of_generation(choice):
            break
        position = len(sequence) - 1
        step = StepRequest(
            key, position, token_ids=(choice,), expected_past_len=position, sampling=GREEDY, want_logits=True
        )
        result = engine.decode(step)
    engine.close()
    stream = tokenizer.detokenizer()
    text = "".join(stream.feed(t) for t in generated if not tokenizer.is_end_of_generation(t))
    return text + stream.flush()


def test_without_the_key_every_v1_call_is_a_401(node):
    with openai.OpenAI(base_url=f"{node[0]}/v1", api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    assert "API key required" in node[1].read_text()
    with pytest.raises(urllib.error.HTTPError) as metrics:
        urllib.request.urlopen(f"{node[0]}/metrics", timeout=10)
    assert metrics.value.code == 401
    assert json.loads(metrics.value.read())["error"]["code"] == "invalid_api_key"


def test_readiness_and_liveness_need_no_key(node):
    with urllib.request.urlopen(f"{node[0]}/health", timeout=10) as ready:
        body = json.loads(ready.read())
    assert ready.status == 200 and body["status"] == "ok" and len(body["models"]) == 1
    with urllib.request.urlopen(f"{node[0]}/livez", timeout=10) as live:
        assert live.status == 200


def test_generate_sends_the_key_from_the_environment(node):
    done = subprocess.run(
        [sys.executable, "-m", "meshnode", "generate", "--api", node[0], "--prompt", PROMPT,
         "--max-tokens", "4", "--temperature", "0", "--quiet"],
        capture_output=True, text=True, timeout=60, env=os.environ | {"MESHNODE_API_KEY": KEY},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    without_key = {name: value for name, value in os.environ.items() if name != "MESHNODE_API_KEY"}
    refused = subprocess.run(
        [sys.executable, "-m", "meshnode", "generate", "--api", node[0], "--prompt", PROMPT,
         "--api-key", "sk-wrong"],
        capture_output=True, text=True, timeout=60, env=without_key,
    )  # fmt: skip
    assert refused.returncode == 1 and refused.stderr.strip() == (
        "meshnode generate: 401: Incorrect API key provided. "
        "(give the node's key with --api-key KEY or $MESHNODE_API_KEY)"
    )


def test_penalties_change_greedy_output_exactly_as_llama_cpp_computes_them(client, tiny_model):
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    penalized = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        extra_body={"repeat_penalty": 1.3, "repeat_last_n": 32},
    )
    reference = penalized_reference(tiny_model, repeat=1.3, frequency=0.5, presence=0.25, last_n=32)
    unpenalized = penalized_reference(tiny_model, repeat=1.0, frequency=0.0, presence=0.0, last_n=32)
    assert plain.choices[0].text == unpenalized
    assert penalized.choices[0].text == reference
    assert penalized.choices[0].text != plain.choices[0].text


def first_token_ranking(model: Path, prompt: list[int]) -> list[int]:
    """Token ids by the engine's logits for the first generated position, best first."""
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), 0, None, n_ctx=CONTEXT, n_seq_max=1, n_threads=1))
    result = engine.prefill(
        StepRequest(SessionKey("ranking", 1), 0, token_ids=tuple(prompt), sampling=GREEDY, want_logits=True)
    )
    engine.close()
    assert result.logits is not None
    return [int(t) for t in np.argsort(-result.logits, kind="stable")]


def test_logit_bias_bans_and_forces_tokens(client, tiny_model):
    model = client.models.list().data[0].id
    tokenizer = Tokenizer.open(tiny_model)
    prompt = tokenizer.encode_prompt(PROMPT)
    ranking = first_token_ranking(tiny_model, prompt)

    def printable(token: int) -> bool:
        text = tokenizer.piece(token).decode("utf-8", errors="replace")
        return text.isascii() and text.isprintable() and text.strip() != ""

    readable = [t for t in ranking if printable(t)]
    target, unlikely = readable[1], readable[-1]

    def first_text(bias: dict[str, float]) -> str:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias=bias
        )
        return completion.choices[0].text

    # Every token the engine ranks above the target banned: greedy picks the target.
    banned = {str(t): -100.0 for t in ranking[: ranking.index(target)]}
    assert banned and first_text(banned) == tokenizer.detokenize([target])
    assert first_text({str(unlikely): 100.0}) == tokenizer.detokenize([unlikely])


def test_the_same_seed_gives_the_same_sampled_text(client):
    model = client.models.list().data[0].id

    def sampled(seed: int) -> str:
        completion = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=1.0, top_p=0.95, seed=seed
        )
        return completion.choices[0].text

    first = sampled(1234)
    assert sampled(1234) == first
    assert len({sampled(seed) for seed in (1, 2, 3, 4)} | {first}) > 1


def test_the_official_client_retrieves_the_served_model(client):
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-" + model)


def test_include_usage_with_the_official_client(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 5
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_refusals_name_the_field(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2)
    assert (unsupported.value.param, unsupported.value.code) == ("n", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="x", max_tokens=CONTEXT + 1)
    assert (too_long.value.param, too_long.value.code) == ("max_tokens", "context_length_exceeded")
    # Up to the context is accepted; generation ends where the context is full.
    whole = client.completions.create(model=model, prompt="x", max_tokens=CONTEXT, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop")


def test_a_prompt_longer_than_the_context_is_refused_before_any_prefill(client):
    """The refusal names the prompt's length: the API found it, not a hop after a context's
    worth of prefill (that refusal names a position instead)."""
    model = client.models.list().data[0].id
    prompt = [7] * (CONTEXT + 1)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert (too_long.value.param, too_long.value.code) == ("prompt", "context_length_exceeded")
    assert f"the prompt has {CONTEXT + 1}" in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as chat_too_long:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a " * 4 * CONTEXT}]
        )
    assert (chat_too_long.value.param, chat_too_long.value.code) == ("messages", "context_length_exceeded")
    # A prompt that fills the context exactly still gets its one token.
    full = client.completions.create(model=model, prompt=prompt[:CONTEXT], max_tokens=1, temperature=0)
    assert full.usage is not None and (full.usage.prompt_tokens, full.usage.completion_tokens) == (CONTEXT, 1)


def end_of_generation_token(tokenizer: Tokenizer) -> int:
    return next(t for t in range(tokenizer.n_vocab) if tokenizer.is_end_of_generation(t))


def test_json_mode_with_the_official_client(client, tiny_model):
    """The tiny model's weights are random: biases make its free choice the wrong one (end at
    once, a bare brace), so only the grammar can make the answer JSON."""
    model = client.models.list().data[0].id
    tokenizer = Tokenizer.open(tiny_model)
    eos = end_of_generation_token(tokenizer)
    close_brace = tokenizer.tokenize("}", add_special=False)[-1]
    bias = {str(eos): 100, str(close_brace): 50}
    messages = [{"role": "user", "content": "Answer in JSON."}]
    free = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logit_bias=bias
    )
    assert free.choices[0].message.content == ""  # ends at once without a grammar
    json_object = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logit_bias=bias,
        response_format={"type": "json_object"},
    )
    assert json.loads(json_object.choices[0].message.content) == {}
    assert json_object.choices[0].finish_reason == "stop"

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for seed in (1, 2):
        shaped = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=32,
            temperature=1.0,
            seed=seed,
            logit_bias={str(eos): 100},
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}},
        )
        assert isinstance(json.loads(shaped.choices[0].message.content)["ok"], bool)
