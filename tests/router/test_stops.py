"""Stop strings: exact truncation, hold-back of partial matches, chunking independence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdd.router.text.stops import StopStep, StopStringMatcher


def test_partial_stop_is_held_then_dropped_on_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == StopStep("abc ")
    assert m.feed("OP and more") == StopStep("", stopped=True, stop="STOP")
    assert m.stopped


def test_partial_stop_that_does_not_complete_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == StopStep("abc ")
    assert m.feed("ART") == StopStep("START")
    assert m.feed("x S") == StopStep("x ")
    assert m.flush() == "S"


def test_include_stop_string_in_output():
    m = StopStringMatcher(["\n\n"], include_in_output=True)
    assert m.feed("one\n") == StopStep("one")
    assert m.feed("\ntwo") == StopStep("\n\n", stopped=True, stop="\n\n")


def test_first_completed_match_wins_across_stops():
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == StopStep("xa", stopped=True, stop="bc")
    m = StopStringMatcher(["c", "bc"])  # both complete at the same character: earliest start
    assert m.feed("abcd") == StopStep("a", stopped=True, stop="bc")


def test_overlapping_prefix_is_held_by_longest_candidate():
    m = StopStringMatcher(["aab"])
    assert m.feed("xa") == StopStep("x")
    assert m.feed("a") == StopStep("")
    assert m.feed("ab") == StopStep("a", stopped=True, stop="aab")


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == StopStep("anything")
    assert m.flush() == ""


def test_feed_after_stop_and_empty_stop_are_errors():
    m = StopStringMatcher(["x"])
    m.feed("x")
    with pytest.raises(RuntimeError):
        m.feed("y")
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def reference(text: str, stops: list[str], include: bool) -> str:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text
    return text[: best[0] + (len(best[1]) if include else 0)]


ALPHABET = st.text(alphabet="abc\n", max_size=30)


@given(ALPHABET, st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(1, 6), max_size=30), st.booleans())  # fmt: skip
def test_streamed_output_equals_reference_for_any_chunking(text, stops, cuts, include):
    m = StopStringMatcher(stops, include_in_output=include)
    out, i = [], 0
    for n in cuts + [len(text)]:
        step = m.feed(text[i : i + n])
        out.append(step.text)
        i += n
        # Nothing emitted so far may contain a stop string (unless it is the included one).
        if not include:
            assert not any(s in "".join(out) for s in stops)
        if step.stopped or i >= len(text):
            break
    if not m.stopped:
        out.append(m.flush())
    assert "".join(out) == reference(text, stops, include)
