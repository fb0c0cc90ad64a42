"""Tool calls read as the answer's text comes (sparkv/runtime/toolstream.py): however the text
is cut into pieces, the pieces shown add up to the calls a whole read finds; a call is named
as soon as its arguments begin and its arguments come as written; a repeat of a call made
before is never shown, not even its beginning; a call cut off stays as far as it was shown;
prose and unknown tools show nothing."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from test_runtime_toolform import TOOLS
from sparkv.runtime.jsonform import complete, feed, first_bytes, may_end, step
from sparkv.runtime.toolform import ToolSet, call_text
from sparkv.runtime.toolstream import CallReader

NAMES = ["note", "get_time", "get_weather"]


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _shown(text: str, cuts: list[int]) -> tuple[list, dict[int, str], CallReader]:
    """The pieces of ``text`` fed cut at ``cuts``, each call's arguments put together."""
    reader, pieces, args = CallReader(NAMES), [], {}
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        for p in reader.feed(text[a:b]):
            pieces.append(p)
            args[p.place] = args.get(p.place, "") + p.arguments
    return pieces, args, reader


def test_a_call_is_named_when_its_arguments_begin_and_they_come_as_written():
    text = _call("get_time", '{"zone": "U}{\\"TC"}')
    reader = CallReader(NAMES)
    assert reader.feed(text[:30]) == []                       # its name not yet whole
    first = reader.feed(text[30:52])
    assert [(p.place, p.name, p.done) for p in first] == [(0, "get_time", False)]
    assert first[0].id.startswith("call_") and first[0].arguments == text[46:52]
    rest = reader.feed(text[52:])
    assert rest[-1].done and rest[-1].name is None and rest[-1].id == first[0].id
    assert "".join(p.arguments for p in first + rest) == '{"zone": "U}{\\"TC"}'
    (call,) = reader.calls()
    assert call.complete and json.loads(call.arguments) == {"zone": 'U}{"TC'}


def test_a_repeat_is_never_shown_and_a_held_call_shows_once_it_differs():
    one = _call("note", '{"a": 1, "b": 2}')
    text = one + "\n" + one + "\n" + _call("note", '{"a": 1, "c": 3}')
    pieces, args, reader = _shown(text, list(range(len(text))))    # a byte at a time
    assert sorted(args) == [0, 1] and args == {0: '{"a": 1, "b": 2}', 1: '{"a": 1, "c": 3}'}
    second = [p for p in pieces if p.place == 1]
    assert second[0].name == "note" and second[0].arguments == '{"a": 1, "c'  # held until "c"
    assert [(c.name, c.arguments) for c in reader.calls()] == [
        ("note", '{"a": 1, "b": 2}'), ("note", '{"a": 1, "c": 3}')]
    held = CallReader(NAMES)                    # a repeat cut off while held: never shown
    held.feed(one + "\n" + one[:-20])
    assert len(held.calls()) == 1


def test_a_repeat_spaced_otherwise_is_a_repeat_but_a_string_spaced_otherwise_is_not():
    """Repeats are told by the arguments without the whitespace between JSON tokens: a call
    spaced otherwise is held back and dropped, a byte at a time or whole; whitespace inside a
    string makes another call, shown once it differs."""
    first = _call("note", '{"a": 1, "b": "x y"}')
    spaced = _call("note", '{ "a":1,\n  "b" :  "x y" }')
    other = _call("note", '{"a":1,"b":"x  y"}')
    text = first + "\n" + spaced + "\n" + other
    pieces, args, reader = _shown(text, list(range(len(text))))
    assert args == {0: '{"a": 1, "b": "x y"}', 1: '{"a":1,"b":"x  y"}'} and reader.repeats == 1
    second = [p for p in pieces if p.place == 1]
    assert second[0].arguments == '{"a":1,"b":"x  '                # held until the 2nd space
    whole = CallReader(NAMES)
    whole.feed(text)
    assert [c.arguments for c in whole.calls()] == [args[0], args[1]]


def test_a_call_cut_off_stays_as_far_as_shown_and_prose_or_unknown_tools_show_nothing():
    text = _call("note", "{}") + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CE'
    pieces, args, reader = _shown(text, [10, 40, 70])
    calls = reader.calls()
    assert [(c.arguments, c.complete) for c in calls] == [("{}", True), ('{"zone": "CE', False)]
    assert args == {0: "{}", 1: '{"zone": "CE'} and not pieces[-1].done
    for other in ("It is sunny.", _call("nope", "{}"), "  <tool_call>\n{\"name\": \"no"):
        r = CallReader(NAMES)
        assert r.feed(other) == [] and r.calls() == []
    assert CallReader(NAMES).feed("It") == [] and CallReader(NAMES).feed("<to") == []


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 600), max_size=12),
       st.sampled_from(["required", "auto"]))
def test_any_cut_of_a_form_walk_shows_the_calls_a_whole_read_finds(seed, cuts, choice):
    """Random walks through the tool form, repeats made likely, cut anywhere (the token cap
    too): the pieces of each call add up to its arguments, in the order of a whole read, each
    call named once and closed once iff it is complete."""
    tools, rng = ToolSet(TOOLS, choice), random.Random(seed)
    form = tools.form()
    made = [call_text("note", "{}"), call_text("get_time", '{"zone": "UTC"}')]
    out = bytearray(rng.choice(made).encode() if rng.random() < 0.7 else b"")
    s = feed(form.start(), bytes(out))
    while s is not None and not complete(s) and len(out) < 500:
        if may_end(s) and rng.random() < 0.2:
            break
        if out and rng.random() < 0.3 and feed(s, b"\n" + made[0].encode()) is not None:
            out += b"\n" + made[0].encode()                 # a repeat
            s = feed(s, b"\n" + made[0].encode())
            continue
        ok = [b for b, fits in enumerate(first_bytes(s)) if fits]
        short = [b for b in ok if b in b'}]",:0<\n']
        out.append(rng.choice(short if short and rng.random() < 0.8 else ok))
        s = step(s, out[-1])
    text = out.decode(errors="ignore")
    whole = tools.read(text)
    pieces, args, reader = _shown(text, cuts)
    assert [(c.name, c.arguments, c.complete) for c in reader.calls()] == [
        (c.name, c.arguments, c.complete) for c in whole]
    assert [args[k] for k in range(len(whole))] == [c.arguments for c in whole]
    assert [p.place for p in pieces if p.name is not None] == list(range(len(whole)))
    assert [p.place for p in pieces if p.done] == [k for k, c in enumerate(whole) if c.complete]
    assert len({(c.name, c.arguments) for c in whole if c.complete}) == sum(
        c.complete for c in whole)                          # no repeat shown
