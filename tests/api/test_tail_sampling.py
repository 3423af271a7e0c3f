"""The tail's logit adjustments (bias, llama.cpp's penalties), min_p, the penalty history a tail
session keeps, and how the parameters travel in the route."""

import numpy as np
import pytest

from engines.interface import GREEDY, SamplingParams
from engines.sampling import (
    SamplingHistory,
    adjusted_logits,
    sample_token,
    validate_sampling,
    with_history,
    with_prompt_history,
)
from meshnode.dataplane.errors import ShardProtocolError
from meshnode.dataplane.route import make_route, sampling_from_pb, sampling_to_pb, validate_route
from meshnode.wire.pb import shard

RNG = np.random.default_rng(7)
LOGITS = RNG.normal(size=512).astype(np.float32)
BEST = int(np.argmax(LOGITS))


def test_no_adjustment_leaves_greedy_a_bare_argmax_of_the_engine_array():
    # Read-only, like a view into the engine's logits: an in-place change would raise.
    frozen = LOGITS.copy()
    frozen.setflags(write=False)
    assert sample_token(frozen, GREEDY) == BEST
    assert not GREEDY.adjusts_logits
    assert with_history(GREEDY) is GREEDY
    assert (
        sample_token(frozen, SamplingParams(repeat_penalty=2.0, recent_tokens=(BEST,), recent_tokens_end=1))
        != BEST
    )


def test_penalties_follow_llama_cpp_arithmetic():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    params = SamplingParams(
        repeat_penalty=2.0,
        frequency_penalty=0.25,
        presence_penalty=0.5,
        recent_tokens=(0, 1, 1, 3),
        recent_tokens_end=4,
    )
    adjusted = adjusted_logits(logits, params)
    # Positive logits divided, negative multiplied; then count * frequency + presence subtracted.
    expected = np.array([2.0 / 2 - 0.25 - 0.5, -2.0 * 2 - 2 * 0.25 - 0.5, 1.0, 0.5 / 2 - 0.25 - 0.5])
    np.testing.assert_allclose(adjusted, expected.astype(np.float32), rtol=0, atol=1e-6)
    assert logits[0] == 2.0  # the engine's array is left alone


def test_a_repeat_penalty_steers_greedy_away_from_a_repeated_token():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    assert sample_token(logits, GREEDY) == 0
    penalized = SamplingParams(repeat_penalty=1.3, recent_tokens=(0,), recent_tokens_end=1)
    assert sample_token(logits, penalized) == 1
    # A penalty with nothing to look back on changes nothing.
    assert sample_token(logits, SamplingParams(repeat_penalty=1.3)) == 0


def test_logit_bias_bans_and_forces():
    banned = SamplingParams(logit_bias=((BEST, -100.0),))
    assert sample_token(LOGITS, banned) != BEST
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias=((11, 100.0),))
    assert {sample_token(LOGITS, forced, i) for i in range(20)} == {11}


def test_min_p_keeps_only_tokens_near_the_best():
    logits = np.array([5.0, 4.9, 0.0, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=1, min_p=0.5)
    assert {sample_token(logits, params, i) for i in range(200)} == {0, 1}
    unrestricted = SamplingParams(temperature=1.0, seed=1)
    assert {sample_token(logits, unrestricted, i) for i in range(2000)} >= {0, 1, 2}


def test_the_history_serves_the_prompt_then_what_the_tail_sampled():
    params = with_prompt_history(SamplingParams(repeat_penalty=1.5, penalty_last_n=4), [9, 8, 7, 6, 5])
    assert (params.recent_tokens, params.recent_tokens_end) == ((8, 7, 6, 5), 5)
    history = SamplingHistory(params)
    assert history.params_at(5).recent_tokens == (8, 7, 6, 5)
    history.record(5, 100)
    assert history.params_at(6).recent_tokens == (7, 6, 5, 100)
    history.record(6, 101)
    history.record(6, 101)  # a retried step records the same token at the same position
    window = history.params_at(7)
    assert (window.recent_tokens, window.recent_tokens_end) == ((6, 5, 100, 101), 7)
    # A replay asks for earlier positions again and gets what they saw the first time.
    assert history.params_at(6).recent_tokens == (7, 6, 5, 100)


def test_a_sampler_with_history_records_its_draws_and_repeats_them_on_replay():
    logits = np.array([3.0, 2.9, 2.8, 0.0], dtype=np.float32)
    params = with_history(with_prompt_history(SamplingParams(repeat_penalty=2.0), [3]))
    drawn = [sample_token(logits, params, position) for position in range(1, 5)]
    # Each draw is penalised by the ones before it: no token repeats while others are close.
    assert drawn[:3] == [0, 1, 2]
    replayed = with_history(with_prompt_history(SamplingParams(repeat_penalty=2.0), [3]))
    assert [sample_token(logits, replayed, position) for position in range(1, 5)] == drawn


def test_parameters_without_penalties_carry_no_tokens():
    assert with_prompt_history(GREEDY, [1, 2, 3]) is GREEDY
    assert with_prompt_history(SamplingParams(logit_bias=((1, 1.0),)), [1, 2]).recent_tokens == ()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_p=1.5),
        SamplingParams(repeat_penalty=0.0),
        SamplingParams(frequency_penalty=float("inf")),
        SamplingParams(penalty_last_n=5000),
        SamplingParams(penalty_last_n=1, recent_tokens=(1, 2)),
        SamplingParams(logit_bias=((1, float("nan")),)),
    ],
)
def test_the_engine_refuses_parameters_no_sampler_can_act_on(params):
    from engines.interface import EngineError

    with pytest.raises(EngineError):
        validate_sampling(params)


def test_the_route_carries_every_sampling_field():
    # Values a float32 holds exactly: the wire's floats are llama.cpp's float32.
    params = SamplingParams(
        temperature=0.75,
        top_k=40,
        top_p=0.875,
        seed=2**63 + 5,
        min_p=0.125,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repeat_penalty=1.25,
        penalty_last_n=3,
        logit_bias=((2, -100.0), (9, 1.5)),
        recent_tokens=(4, 5, 6),
        recent_tokens_end=10,
    )
    assert sampling_from_pb(sampling_to_pb(params)) == params
    assert sampling_from_pb(sampling_to_pb(GREEDY)) == GREEDY


def test_the_tail_plan_holds_a_history_and_other_hops_do_not():
    route = make_route(sampling=SamplingParams(repeat_penalty=1.2, recent_tokens=(1,), recent_tokens_end=1))
    tail = validate_route(route, end_layer=4, is_tail=True)
    assert isinstance(tail.sampling.history, SamplingHistory)
    middle = validate_route(route, end_layer=2, is_tail=False)
    assert middle.sampling.history is None
    assert tail.sampling == middle.sampling  # the history is not part of what they mean


@pytest.mark.parametrize(
    "field_values",
    [
        {"min_p": 2.0},
        {"repeat_penalty": float("nan")},
        {"presence_penalty": float("inf")},
        {"penalty_last_n": 10_000},
        {"penalty_last_n": 1, "recent_tokens": [1, 2], "recent_tokens_end": 2},
        {"penalty_last_n": 8, "recent_tokens": [1, 2], "recent_tokens_end": 1},
    ],
)
def test_a_route_with_corrupt_sampling_is_refused(field_values):
    message = sampling_to_pb(SamplingParams())
    for name, value in field_values.items():
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    with pytest.raises(ShardProtocolError) as refused:
        sampling_from_pb(message)
    assert refused.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


@pytest.fixture(scope="module")
def tiny_vocabulary():
    from engines.grammar import grammar_vocab
    from engines.tiny_model import ensure_tiny_model
    from engines.tokenizer import Tokenizer

    path = ensure_tiny_model()
    tokenizer = Tokenizer.open(path)
    yield tokenizer, grammar_vocab(path)
    tokenizer.close()


def grammars_over(vocabulary):
    """The grammar source an engine holding ``vocabulary`` hands its sampler."""
    from engines.grammar import GrammarConstraint

    return lambda grammar: GrammarConstraint(vocabulary, grammar)


def generate_to_grammar(tokenizer, vocabulary, params, logits, *, start=5, steps=12) -> list[int]:
    tokens = []
    for position in range(start, start + steps):
        token = sample_token(logits, params, position, grammars_over(vocabulary))
        tokens.append(token)
        if tokenizer.is_end_of_generation(token):
            break
    return tokens


def test_json_mode_follows_the_grammar_where_the_free_choice_would_not(tiny_vocabulary):
    from engines.json_grammar import json_grammar

    tokenizer, vocabulary = tiny_vocabulary
    eos = next(t for t in range(tokenizer.n_vocab) if tokenizer.is_end_of_generation(t))
    close_brace = tokenizer.tokenize("}", add_special=False)[-1]
    logits = np.zeros(tokenizer.n_vocab, dtype=np.float32)
    logits[eos], logits[close_brace] = 20.0, 10.0  # left alone: end at once, or a bare "}"
    params = with_history(with_prompt_history(SamplingParams(grammar=json_grammar()), [1, 2, 3, 4, 5]))
    tokens = generate_to_grammar(tokenizer, vocabulary, params, logits)
    assert tokenizer.detokenize(tokens[:-1]) == "{}" and tokens[-1] == eos
    # Without the grammar the same logits end the generation at once.
    assert sample_token(logits, GREEDY) == eos


def test_a_json_schema_grammar_gives_json_of_that_shape(tiny_vocabulary):
    import json

    from engines.json_grammar import json_grammar

    tokenizer, vocabulary = tiny_vocabulary
    logits = np.random.default_rng(3).normal(size=tokenizer.n_vocab).astype(np.float32)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    eos = next(t for t in range(tokenizer.n_vocab) if tokenizer.is_end_of_generation(t))
    logits[eos] = 30.0  # ends as soon as the grammar lets it
    params = with_history(with_prompt_history(SamplingParams(grammar=json_grammar(schema)), [1, 2]))
    tokens = generate_to_grammar(tokenizer, vocabulary, params, logits, start=2, steps=40)
    assert tokens[-1] == eos
    assert set(json.loads(tokenizer.detokenize(tokens[:-1]))) == {"a"}


def test_the_grammar_state_is_rebuilt_for_a_retried_or_replayed_position(tiny_vocabulary):
    from engines.json_grammar import json_grammar

    tokenizer, vocabulary = tiny_vocabulary
    logits = np.random.default_rng(5).normal(size=tokenizer.n_vocab).astype(np.float32)
    params = with_history(
        with_prompt_history(SamplingParams(temperature=1.0, seed=4, grammar=json_grammar()), [7, 7, 7])
    )
    grammars = grammars_over(vocabulary)
    first = [sample_token(logits, params, position, grammars) for position in range(3, 9)]
    # A replay asks again from the first generated position; a retry repeats one step.
    assert [sample_token(logits, params, position, grammars) for position in range(3, 9)] == first
    assert sample_token(logits, params, 6, grammars) == first[3]


def test_an_engine_without_a_vocabulary_refuses_a_grammar():
    from engines.interface import EngineError
    from engines.json_grammar import json_grammar

    params = with_history(with_prompt_history(SamplingParams(grammar=json_grammar()), [1]))
    with pytest.raises(EngineError, match="cannot sample to a grammar"):
        sample_token(LOGITS, params, 1, lambda grammar: None)
