"""The head's side of speculative decoding, pure: prompt-lookup drafts, the greedy acceptance
rule, and how the draft length adapts (issue 20)."""

from __future__ import annotations

import pytest

from meshnode.head.drafting import DraftConfig, PromptLookup
from meshnode.head.speculation import DraftLength, SpeculationConfig, Speculator, accept_drafts

# ---------------------------------------------------------------------------- drafting


def test_the_draft_is_what_followed_the_newest_earlier_occurrence_of_the_suffix():
    lookup = PromptLookup(DraftConfig(max_ngram=3, min_ngram=2))
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 4 5 9); "2 3" more recently at 6..7 (followed by 7), but
    # the longest n-gram wins.
    assert lookup.propose(tokens, 3) == (4, 5, 9)


def test_a_shorter_ngram_is_used_when_the_longer_never_occurred():
    lookup = PromptLookup(DraftConfig(max_ngram=3, min_ngram=2))
    tokens = [8, 2, 3, 7, 6, 5, 2, 3]
    assert lookup.propose(tokens, 2) == (7, 6)


def test_no_earlier_occurrence_means_no_draft():
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 4, 5, 6], 4) == ()
    assert lookup.propose([1], 4) == ()
    assert lookup.propose([1, 2, 1, 2], 0) == ()


def test_the_suffix_itself_is_never_its_own_match():
    lookup = PromptLookup(DraftConfig(max_ngram=2, min_ngram=2))
    assert lookup.propose([4, 5], 3) == ()


def test_a_repeating_pattern_drafts_past_its_period():
    lookup = PromptLookup()
    assert lookup.propose([7, 1, 2, 3, 1, 2, 3], 7) == (1, 2, 3, 1, 2, 3, 1)


def test_the_index_grows_with_the_transcript_and_answers_as_a_fresh_one_would():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = PromptLookup(DraftConfig(max_ngram=3, min_ngram=1))
    for end in range(1, len(tokens) + 1):
        fresh = PromptLookup(DraftConfig(max_ngram=3, min_ngram=1))
        assert grown.propose(tokens[:end], 4) == fresh.propose(tokens[:end], 4)


def test_ngram_lengths_are_checked():
    with pytest.raises(ValueError):
        DraftConfig(max_ngram=1, min_ngram=2)


# ---------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize(
    ("draft", "choices", "kept"),
    [
        ((4, 5, 6), (4, 5, 6, 7), (4, 5, 6, 7)),  # all accepted, plus the bonus token
        ((4, 5, 6), (4, 9, 6, 7), (4, 9)),  # the second draft rejected: its correction ends the round
        ((4, 5, 6), (8, 5, 6, 7), (8,)),  # none accepted: plain decoding's token
        ((4, 5, 6), (4, 5, 1, 1), (4, 5, 1)),
        ((), (3,), (3,)),
    ],
)
def test_the_longest_agreeing_prefix_plus_the_models_next_choice(draft, choices, kept):
    assert accept_drafts(draft, choices) == kept


def test_a_round_answered_with_the_wrong_number_of_choices_is_refused():
    with pytest.raises(ValueError):
        accept_drafts((1, 2), (1, 2))


# ---------------------------------------------------------------------------- the draft length


def test_full_acceptance_doubles_the_draft_up_to_the_maximum():
    length = DraftLength(SpeculationConfig(max_draft=8, initial_draft=2))
    lengths = []
    for _ in range(4):
        k = length.next()
        lengths.append(k)
        length.verified(k, k)
    assert lengths == [2, 4, 8, 8]


def test_a_rejection_shrinks_the_draft_to_one_past_what_was_accepted():
    length = DraftLength(SpeculationConfig(max_draft=8, initial_draft=8))
    length.verified(8, 5)
    assert length.next() == 6
    length.verified(6, 0)
    assert length.next() == 1


def test_low_acceptance_pauses_drafting_then_tries_again():
    config = SpeculationConfig(
        max_draft=8, initial_draft=4, low_acceptance=0.25, low_rounds=3, pause_tokens=5
    )
    length = DraftLength(config)
    for _ in range(3):
        length.verified(max(1, length.next()), 0)
    assert length.paused and length.next() == 0
    for _ in range(4):
        length.decoded_plainly()
    assert length.next() == 0
    length.decoded_plainly()
    assert not length.paused and length.next() == 4


def test_an_acceptable_round_breaks_a_low_streak():
    config = SpeculationConfig(low_acceptance=0.25, low_rounds=2, pause_tokens=5)
    length = DraftLength(config)
    length.verified(4, 0)
    length.verified(1, 1)
    length.verified(2, 0)
    assert not length.paused


def test_the_speculator_never_drafts_past_the_limit_and_counts_what_it_kept():
    speculator = Speculator(SpeculationConfig(max_draft=8, initial_draft=8))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert speculator.propose(tokens, 2) == (3, 1)
    assert speculator.propose(tokens, 0) == ()
    draft = speculator.propose(tokens, 8)
    assert draft == (3, 1, 2, 3, 1, 2, 3, 1)
    kept = speculator.verified(draft, (3, 1, 2, 9, 0, 0, 0, 0, 0))
    assert kept == (3, 1, 2, 9)
    assert (speculator.stats.rounds, speculator.stats.drafted, speculator.stats.accepted) == (1, 8, 3)
    assert speculator.stats.acceptance == pytest.approx(3 / 8)
    assert speculator.length.next() == 4
