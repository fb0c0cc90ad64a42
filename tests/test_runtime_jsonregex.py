"""Patterns of JSON answers (sparkv.runtime.jsonregex): a string matches exactly when Python's
``re.search`` says it does, over the syntax taken; what it does not take is refused by name."""

from __future__ import annotations

import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkv.runtime.jsonregex import FORMATS, Pattern, PatternError

PATTERNS = [r"^\d{4}-\d{2}-\d{2}$", r"^[A-Z][a-z]+( [A-Z][a-z]+)*$", r"ab|cd", r"^a{0}b$",
            r"^(ab){2,3}$", r"^x?y*z+$", r"^[^0-9 ]+$", r"^\w+@\w+\.com$", r"a.c", r"^(?:a|b)+$",
            r"^[a-c-]{1,}$", r"\d", r"^$", r"^a{2,}b?$", r"[\d.]+$"]


def _matches(p: Pattern, text: str) -> bool:
    states = p.start()
    for b in text.encode():
        states = p.step(states, b)
        if not states:
            return False
    return p.accepts(states)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet="abcdxyzAB 0123.@-com", max_size=12))
def test_a_string_matches_as_python_re_search_says(pattern, text):
    assert _matches(Pattern.compile(pattern), text) == (re.search(pattern, text) is not None)


@pytest.mark.parametrize("name, good, bad", [
    ("date", "2026-12-03", "2026-12-32"), ("time", "06:31:33.5Z", "06:31:33"),
    ("date-time", "2026-12-03T06:31:33+01:00", "2026-12-03 06:31:33+01:00"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b-12d3-a456-42661417400")])
def test_the_formats_take_their_rfc_texts(name, good, bad):
    p = Pattern.compile(FORMATS[name])
    assert _matches(p, good) and not _matches(p, bad)


@pytest.mark.parametrize("pattern, says", [
    ("(?=a)", "lookarounds"), ("a{2,1}", "n <= m"), ("[z-a]", "not a range"), ("é", "ASCII"),
    ("a^b", "start (^)"), ("(ab", "not closed"), ("[ab", "not closed"), ("\\1", "\\1"),
    ("a{100}", "at most 64"), ('a"', "ASCII"), ("[^ -~]", "no character"), ("*a", "stands where"),
    ("((a{64}){64}){64}", "too large")])
def test_what_is_not_taken_is_refused_by_name(pattern, says):
    with pytest.raises(PatternError, match=re.escape(says)):
        Pattern.compile(pattern)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab1^$.|?*+(){}[]-\\,:dws23", max_size=10),
       st.lists(st.text(alphabet="ab1-2 ,:d", max_size=6), max_size=4))
def test_any_text_compiles_or_is_refused_and_what_compiles_matches_as_python_does(text, strings):
    """What a client may send as a pattern: never another exception; where Python's re takes
    it too, the same strings match."""
    try:
        pattern = Pattern.compile(text)
    except PatternError:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")               # "possible nested set" and such
            python = re.compile(text)
    except re.error:
        return
    for s in strings:
        assert _matches(pattern, s) == (python.search(s) is not None), (text, s)
