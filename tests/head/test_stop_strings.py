from hypothesis import given
from hypothesis import strategies as st

from meshnode.head.stop_strings import StopMatcher


def run(stops, deltas):
    matcher = StopMatcher(tuple(stops))
    out = "".join(matcher.feed(d) for d in deltas) + matcher.flush()
    return out, matcher.stopped


def test_stop_straddling_deltas_is_caught_and_nothing_after_it_leaks():
    assert run(["\n\nUser:"], ["Hello", " world\n", "\nUs", "er: more"]) == ("Hello world", True)


def test_partial_prefix_is_released_when_it_turns_out_harmless():
    matcher = StopMatcher(("END",))
    assert matcher.feed("the EN") == "the "
    assert matcher.feed("D") == ""
    assert matcher.stopped
    matcher = StopMatcher(("END",))
    assert matcher.feed("the EN") == "the "
    assert matcher.feed("ding") == "ENding"
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins_and_empty_stops_are_ignored():
    assert run(["b", "", "cd"], ["a cd b"]) == ("a ", True)
    assert run([], ["anything"]) == ("anything", False)


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stop=st.text(alphabet="abc\n", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streaming_equals_matching_on_the_whole_text(text, stop, cuts):
    points = sorted(set(min(c, len(text)) for c in cuts))
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    index = text.find(stop)
    expected = (text[:index], True) if index >= 0 else (text, False)
    assert run([stop], deltas) == expected
