"""The vocab-only tokenizer on the tiny model (and Gemma's template fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tokenizer import Tokenizer, TokenizerError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello mesh"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    with Tokenizer.open(tiny_model) as opened:
        yield opened


def test_round_trip_including_byte_fallback(tokenizer: Tokenizer) -> None:
    text = "hello world, the shard runs: héllo ✓ 日本"
    tokens = tokenizer.tokenize(text)
    assert tokens[0] == tokenizer.bos_token
    assert tokenizer.detokenize(tokens).strip() == text
    assert tokenizer.tokenize(text, add_special=False)[0] != tokenizer.bos_token
    assert tokenizer.encode_prompt("<|im_start|>x") == tokenizer.tokenize("<|im_start|>x"), (
        "no control tokens"
    )
    assert len(tokenizer.tokenize("the")) < len(tokenizer.tokenize("xqz")), "known words merge into pieces"


def test_streaming_holds_back_split_utf8_characters(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.tokenize("a✓b", add_special=False)
    pieces = [tokenizer.piece(t) for t in tokens]
    assert sum(len(p) == 1 and p[0] >= 0x80 for p in pieces) == 3, "✓ is three byte-fallback tokens"
    stream = tokenizer.detokenizer()
    emitted = [stream.feed(t) for t in tokens]
    assert "".join(emitted) + stream.flush() == " a✓b"
    assert all("\ufffd" not in part for part in emitted)
    cut = tokenizer.detokenizer()
    for token in tokens[:-2]:  # stop in the middle of ✓
        cut.feed(token)
    assert cut.flush() == "\ufffd"


def test_chat_template_and_end_of_generation(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello mesh<|im_end|>\n<|im_start|>assistant\n"
    )
    tokens = tokenizer.encode_chat(MESSAGES)
    im_start = tokenizer.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and tokens.count(im_start[0]) == 3
    assert tokenizer.tokenize("<|im_start|>", add_special=False).count(im_start[0]) == 0, (
        "user text stays text"
    )
    end = tokenizer.tokenize("<|im_end|>", add_special=False, parse_special=True)[0]
    assert tokenizer.is_end_of_generation(end) and tokenizer.is_end_of_generation(tokenizer.eos_token)
    assert not tokenizer.is_end_of_generation(im_start[0])


def test_out_of_range_token_is_a_clear_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        tokenizer.piece(tokenizer.n_vocab)


@pytest.mark.slow
def test_gemma_without_a_template_uses_llama_cpps_gemma_format(gemma_model: Path) -> None:
    with Tokenizer.open(gemma_model) as gemma:
        assert (
            gemma.apply_chat_template(MESSAGES[1:])
            == "<start_of_turn>user\nhello mesh<end_of_turn>\n<start_of_turn>model\n"
        )
        tokens = gemma.encode_chat(MESSAGES[1:])
        end_of_turn = gemma.tokenize("<end_of_turn>", add_special=False, parse_special=True)
        assert tokens[0] == gemma.bos_token and len(end_of_turn) == 1 and end_of_turn[0] in tokens
        assert gemma.is_end_of_generation(end_of_turn[0])
        assert gemma.detokenize(gemma.tokenize("Grüße, 世界", add_special=False)) == "Grüße, 世界"


@pytest.mark.slow
@pytest.mark.parametrize(
    "layers, holds",
    [((0, 9), True), ((9, 18), True), ((6, 12), False)],
    ids=["head-slice", "tail-slice", "middle-slice"],
)
def test_a_head_tokenizes_with_its_shards_own_vocabulary(
    gemma_model: Path, tmp_path: Path, layers: tuple[int, int], holds: bool
) -> None:
    """The head of a node whose shard holds the vocabulary borrows it instead of loading a
    second copy (about 40 MiB for Gemma 3): same tokens, template and pieces as the file's;
    closing the tokenizer leaves the engine's model to the engine."""
    from engines.interface import LoadRequest, SessionKey, StepRequest
    from engines.llama_engine import LlamaShardEngine

    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(str(gemma_model), *layers, n_ctx=256, n_seq_max=1, n_threads=1, cache_dir=str(tmp_path))
    )
    try:
        model = engine.vocabulary_model()
        assert (model is not None) == holds
        if model is None:
            return
        borrowed = Tokenizer.borrowing(gemma_model, model)
        with Tokenizer.open(gemma_model) as own:
            text = "The sea was calm: héllo ✓ 日本 <start_of_turn>"
            assert borrowed.encode_prompt(text) == own.encode_prompt(text)
            assert borrowed.encode_chat(MESSAGES) == own.encode_chat(MESSAGES)
            assert borrowed.chat_template == own.chat_template and borrowed.architecture == own.architecture
            assert (borrowed.bos_token, borrowed.eos_token, borrowed.n_vocab) == (
                own.bos_token,
                own.eos_token,
                own.n_vocab,
            )
            tokens = own.encode_prompt(text)
            assert [borrowed.piece(t) for t in tokens] == [own.piece(t) for t in tokens]
        borrowed.close()
        # The engine's model is still there: it computes.
        if layers[0] == 0:
            result = engine.prefill(StepRequest(SessionKey("after", 1), 0, token_ids=tuple(tokens)))
            assert result.hidden is not None or result.token_id is not None
        else:
            assert engine.vocabulary_model() is model
    finally:
        engine.close()
