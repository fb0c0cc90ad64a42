"""Tool calls (sparkv.runtime.toolform): tools that cannot be are refused by name; the form of
each tool choice takes the calls it allows whole and nothing else; random walks through it end
in calls read back with arguments valid under their tool's schema; prose with ``auto`` never
begins a call it does not finish."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_runtime_jsonform import _JSONISH, _KEYS
from sparkv.runtime.jsonform import complete, feed, first_bytes, may_end, step
from sparkv.runtime.toolform import (MAX_CALLS, Tool, ToolError, ToolSet, call_text,
                                     response_text)

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}, strict=True)
TIME = Tool("get_time", "The time in a zone", {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}})
NOTE = Tool("note")                                   # no parameters: any object
TOOLS = [WEATHER, TIME, NOTE]


def _call(name: str, args: dict) -> bytes:
    return call_text(name, json.dumps(args)).encode()


def _ends(form, text: bytes) -> bool:
    s = feed(form.start(), text)
    return s is not None and may_end(s)


@pytest.mark.parametrize("make, match", [
    (lambda: ToolSet([Tool("a b")]), "letters"),
    (lambda: ToolSet([NOTE, Tool("note")]), "one name"),
    (lambda: ToolSet([NOTE], "other"), "not one of the tools"),
    (lambda: ToolSet([], "required"), "needs tools"),
    (lambda: ToolSet([Tool("t", parameters={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}}, strict=True)], "required"), "minimum"),
    (lambda: ToolSet([Tool("t", parameters={"type": "object", "$defs": {"s": {
        "anyOf": [{"type": "string"}] * 30}}, "properties": {"a": {
            "anyOf": [{"$ref": "#/$defs/s"}] * 20}}}, strict=True)], "required"), "ambiguous"),
    (lambda: ToolSet([Tool(f"t{i}", parameters={"type": "object", "properties": {"a": {
        "anyOf": [{"type": "string"}] * 200}}}) for i in range(3)]), "ambiguous"),
])
def test_tools_that_cannot_be_are_refused_by_name(make, match):
    with pytest.raises(ToolError, match=match):
        make()


def test_a_loose_tool_whose_schema_cannot_be_enforced_takes_any_object():
    loose = Tool("t", parameters={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}})
    form = ToolSet([loose], "required").form()
    assert _ends(form, _call("t", {"anything": [1]}))


def test_required_takes_calls_of_the_tools_and_nothing_else():
    tools = ToolSet(TOOLS, "required")
    form = tools.form()
    one = _call("get_weather", {"city": "Oslo", "unit": "C"})
    two = one + b"\n" + _call("note", {"x": 1})
    for text in (one, two):
        assert _ends(form, text), text
    for bad in (b"It is sunny.", _call("get_weather", {"city": "Oslo"}),
                _call("get_weather", {"city": "Oslo", "unit": "K"}), _call("nope", {}),
                _call("get_weather", {"city": "x" * 13, "unit": "C"}), one + b"\n\n" + one):
        assert not _ends(form, bad), bad
    calls = tools.read(two.decode())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("note", {"x": 1})]
    assert len({c.id for c in calls}) == 2
    many = b"\n".join([one] * MAX_CALLS)
    assert _ends(form, many) and complete(feed(form.start(), many))


def test_a_named_choice_or_no_parallel_calls_take_one_call():
    named = ToolSet(TOOLS, "get_time").form()
    assert _ends(named, _call("get_time", {"zone": "UTC"}))
    assert not _ends(named, _call("note", {}))
    assert complete(feed(named.start(), _call("get_time", {"zone": "UTC"})))
    single = ToolSet(TOOLS, "required", parallel=False).form()
    one = _call("note", {})
    assert complete(feed(single.start(), one)) and feed(single.start(), one + b"\n") is None


def test_auto_takes_prose_or_calls_and_prose_never_begins_a_call():
    tools = ToolSet(TOOLS, "auto")
    form = tools.form()
    assert _ends(form, b"It is sunny in Oslo.") and _ends(form, b"")
    assert _ends(form, _call("get_time", {"zone": "CET"}))
    assert not _ends(form, b"<tool_call>\nhello")          # begun as a call: must be one
    assert not _ends(form, _call("get_time", {"zone": "CET"})[:-3])
    assert tools.read("It is sunny.") == [] and tools.may_call("<tool") \
        and not tools.may_call("It")
    assert tools.read("<tool_call>\n{\"name\": \"note\", \"argu") == []   # cut off at the cap
    assert tools.read(_call("nope", {}).decode()) == []
    whole, other = _call("note", {}).decode(), _call("note", {"a": 1}).decode()
    assert len(tools.read(whole + "\n" + other)) == 2
    assert len(tools.read(whole + "\n" + whole)) == 1               # a repeat: once
    assert len(tools.read(whole + "\n" + whole[:20])) == 1          # a repeat cut off
    assert [c.complete for c in tools.read(whole + "\n" + other[:-14])] == [True, True]
    cut = tools.read(whole + "\n" + other[:-15])                   # cut off in its arguments
    assert [(c.arguments, c.complete) for c in cut] == [("{}", True), ('{"a": 1', False)]


def test_auto_with_a_response_format_takes_its_json_or_calls():
    from sparkv.runtime.jsonform import JsonForm

    answer = JsonForm.from_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    form = ToolSet(TOOLS, "auto").form(answer)
    assert _ends(form, b'{"a": "x"}') and _ends(form, _call("note", {}))
    assert not _ends(form, b"prose")
    assert ToolSet(TOOLS, "none").form(answer) is answer and ToolSet(TOOLS, "none").form() is None


def test_the_instructions_list_the_tools_the_choice_allows():
    text = ToolSet(TOOLS, "get_time").instructions()
    assert "get_time" in text and "get_weather" not in text and "<tools>" in text
    assert "Do not call" in ToolSet(TOOLS, "none").instructions()
    assert response_text("12:00") == "<tool_response>\n12:00\n</tool_response>"
    assert call_text("f", "not json").endswith('"arguments": "not json"}\n</tool_call>')


@pytest.mark.parametrize("choice", ["required", "auto", "get_weather"])
def test_random_walks_end_in_calls_whose_arguments_their_schemas_take(choice):
    rs = pytest.importorskip("jsonschema_rs")
    tools = ToolSet(TOOLS, choice)
    form, rng, read = tools.form(), random.Random(11), 0
    schemas = {t.name: t.parameters or {"type": "object"} for t in TOOLS}
    for i in range(60):
        out = bytearray(b"<tool_call>" if choice == "auto" and i % 2 else b"")   # half begin one
        s = feed(form.start(), bytes(out))
        while not complete(s) and len(out) < 600:
            if may_end(s) and rng.random() < 0.3:
                break
            ok = [b for b, fits in enumerate(first_bytes(s)) if fits]
            assert ok, f"a dead end after {bytes(out)!r}"
            short = [b for b in ok if b in b'}]",:0<\n']
            b = rng.choice(short if short and rng.random() < 0.8 else ok)
            out.append(b)
            s = step(s, b)
        if not may_end(s):
            continue
        calls = tools.read(out.decode())
        if choice != "auto" or out.lstrip().startswith(b"<tool_call>"):
            assert calls, bytes(out)
        for c in calls:
            assert rs.is_valid(schemas[c.name], json.loads(c.arguments)), c
            read += 1
    assert read >= (15 if choice == "auto" else 30)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c d", "note", ""]),
                          st.none() | st.dictionaries(_KEYS, _JSONISH, max_size=4),
                          st.booleans()), max_size=4),
       st.sampled_from(["none", "auto", "required", "a", "zz"]), st.booleans())
def test_any_tools_given_make_a_tool_set_or_are_a_tool_error(specs, choice, parallel):
    """What a client may send as tools: a form whose random walks read back calls of the
    allowed tools, or a ToolError; never another exception."""
    try:
        tools = ToolSet([Tool(n, "", p, strict) for n, p, strict in specs], choice, parallel)
    except ToolError:
        return
    form = tools.form()
    if form is None:
        return
    rng, s, out = random.Random(len(repr(specs))), form.start(), bytearray(b"<tool_call>")
    s = feed(s, bytes(out))
    while s is not None and not complete(s) and len(out) < 400:
        if may_end(s) and rng.random() < 0.2:
            break
        ok = [b for b, fits in enumerate(first_bytes(s)) if fits]
        assert ok, bytes(out)
        short = [b for b in ok if b in b'}]",:0<\n']
        out.append(rng.choice(short if short and rng.random() < 0.8 else ok))
        s = step(s, out[-1])
    if s is not None and may_end(s):
        allowed = {n for n, _, _ in specs} if choice in ("auto", "required") else {choice}
        assert {c.name for c in tools.read(out.decode())} <= allowed


def test_an_answer_that_repeats_a_call_ends_there():
    """Where parallel calls may come, the form ends the answer once its last call repeats one
    it made (only end-of-sequence fits then), not before and not for a new call; one call
    alone, or a named choice, ends with its call anyway."""
    from sparkv.runtime.guided import FormGuide, TokenBytes

    one, two = _call("note", {"a": 1}), _call("note", {"a": 2})
    vocab = TokenBytes([bytes([b]) for b in range(256)] + [None], (256,))

    def guide_after(tools: ToolSet, text: bytes) -> FormGuide:
        g = FormGuide(tools.form(), vocab)
        for b in text:
            g.advance(b)
        return g

    for choice in ("auto", "required"):
        tools = ToolSet(TOOLS, choice)
        assert not guide_after(tools, one).whole                  # another call may come
        assert not guide_after(tools, one + b"\n" + two).whole
        assert not guide_after(tools, one + b"\n" + one[:-1]).whole
        assert guide_after(tools, one + b"\n" + one).whole        # a repeat: it ends
        assert guide_after(tools, one + b"\n" + two + b"\n" + one).whole
        assert tools.read((one + b"\n" + one).decode())[0].arguments == '{"a": 1}'
    assert ToolSet(TOOLS, "required", parallel=False).form().ends is None
    assert ToolSet(TOOLS, "note").form().ends is None
