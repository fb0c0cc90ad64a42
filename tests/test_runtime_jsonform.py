"""JSON answers (sparkv.runtime.jsonform, sparkv.runtime.guided): the automaton takes every JSON
text of its form whole and goes on from each of its prefixes; every text it takes whole is a
value of the schema (a JSON Schema validator says so) and no reachable state is a dead end;
schemas it cannot enforce are refused by name; the chooser picks, greedy or sampled, only tokens
whose whole text fits, and end-of-sequence once the value is whole, in every generation path."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkv.runtime.guided import FormGuide, TokenBytes, bytes_of_pieces
from sparkv.runtime.jsonform import (MAX_NUMBER_BYTES, MAX_WHITESPACE, FormError, JsonForm,
                                     complete, first_bytes, next_key, step)
from sparkv.runtime.sampling import Sampling, TokenChooser

_SCALARS = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
            | st.floats(allow_nan=False, allow_infinity=False).filter(
                lambda f: f == 0 or 1e-99 < abs(f) < 1e99)      # a two-digit exponent
            | st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.text(max_size=5), c, max_size=4), max_leaves=10)


def _whole(form: JsonForm, text: bytes) -> bool:
    """Whether ``text`` is taken byte by byte, never whole before its end, and whole at it."""
    s = form.start()
    for b in text:
        if complete(s):
            return False
        s = step(s, b)
        if s is None:
            return False
    return complete(s)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _VALUES, max_size=4), st.sampled_from([None, 1]),
       st.booleans())
def test_every_json_object_is_taken_whole_and_no_prefix_of_it_ends_early(obj, indent, ascii):
    assert _whole(JsonForm.any_object(), json.dumps(obj, indent=indent,
                                                    ensure_ascii=ascii).encode())


@pytest.mark.parametrize("text", [
    b"[]", b"1", b'"a"', b'{"a" 1}', b'{"a":01}', b'{"a":1,}', b'{"a":tru}', b'{"a":"\x01"}',
    b"{}x", b'{"a":1.}', b'{"a":"\\x"}', b'{"a":"\\u12G4"}', b'{"a":"\xff"}', b'{"a":"\xc3"}',
    b'{"a":-}', b'{"a":1e}', b'{"a":1e100}', b'{"a":1e-0001}', b"{" + b" " * (MAX_WHITESPACE + 1) + b"}", b"{'a':1}",
    b'{"a":' + b"1" * (MAX_NUMBER_BYTES + 1) + b"}"])
def test_what_is_no_json_object_is_never_taken_whole(text):
    assert not _whole(JsonForm.any_object(), text)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {
              "name": {"type": "string", "minLength": 1, "maxLength": 5},
              "age": {"type": "integer", "description": "years"},
              "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1,
                       "maxItems": 2},
              "nick": {"type": ["string", "null"], "maxLength": 3},
              "where": {"type": "object", "properties": {"x": {"type": "number"},
                                                         "ok": {"type": "boolean"}}},
              "kind": {"const": 'a"b'}, "any": {}, "nothing": {"type": "null"}}}
UNION = {"type": "object", "properties": {"v": {"anyOf": [
    {"type": "string", "minLength": 2}, {"type": "array", "items": {"type": "integer"}},
    {"type": "null"}, {"enum": [1, 10, 100]}]}}}
EMPTY = {"type": "object", "properties": {}}
DATED = {"type": "object", "properties": {
    "day": {"type": "string", "format": "date"}, "at": {"type": "string", "format": "date-time"},
    "id": {"type": "string", "format": "uuid"},
    "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,5}(x|yz)?$"},
    "word": {"type": "string", "pattern": "^ab+c$"}}}
#: what the openai client's parse() sends for a pydantic model (to_strict_json_schema): $defs
#: and $refs, anyOf for an Optional, an enum with its type
PYDANTIC = {
    "$defs": {"Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
              "Inner": {"properties": {"x": {"title": "X", "type": "integer"},
                                       "tag": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                               "title": "Tag"}},
                        "required": ["x", "tag"], "title": "Inner", "type": "object",
                        "additionalProperties": False}},
    "properties": {"name": {"title": "Name", "type": "string"},
                   "color": {"$ref": "#/$defs/Color"},
                   "kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"},
                   "inner": {"$ref": "#/$defs/Inner"},
                   "items": {"items": {"$ref": "#/$defs/Inner"}, "title": "Items",
                             "type": "array"}},
    "required": ["name", "color", "kind", "inner", "items"], "title": "Outer", "type": "object",
    "additionalProperties": False}


#: unions that only a later byte decides: objects of other properties or consts, a number that
#: may be an integer, overlapping strings, and a discriminated oneOf
TWOFOLD = {"type": "object", "properties": {
    "v": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}},
        {"type": "object", "properties": {"kind": {"const": "b"},
                                          "y": {"type": "string", "maxLength": 3}}},
        {"type": "object", "properties": {"kind": {"const": "a"}, "z": {"type": "boolean"}}}]},
    "n": {"type": ["integer", "number"]},
    "w": {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}, "a": {"type": "null"}}},
                    {"type": "object", "properties": {"t": {"const": 2}, "a": {"type": "null"}}}],
          "discriminator": {"propertyName": "t"}},
    "s": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 1}]}}}


@pytest.mark.parametrize("schema", [PERSON, UNION, EMPTY, PYDANTIC, DATED, TWOFOLD,
                                    {"type": "object"}])
def test_a_random_walk_never_dead_ends_and_every_whole_text_is_a_value_of_the_schema(schema):
    rs = pytest.importorskip("jsonschema_rs")
    form, rng, whole, by_key = JsonForm.from_schema(schema), random.Random(7), 0, {}
    for _ in range(150):
        s, out = form.start(), bytearray()
        while not complete(s) and len(out) < 3000:
            firsts = first_bytes(s)
            assert by_key.setdefault(next_key(s), firsts) == firsts   # the mask cache's key
            ok = [b for b, fits in enumerate(firsts) if fits]
            assert ok, f"a dead end after {bytes(out)!r}"
            short = [b for b in ok if b in b'}]",:0e.\n']       # steer walks to an end
            b = rng.choice(short if short and rng.random() < 0.7 else ok)
            out.append(b)
            s = step(s, b)
        if complete(s):
            whole += 1
            value = json.loads(out.decode())
            assert rs.is_valid(schema, value), bytes(out)
    assert whole >= 100


def test_a_schema_text_is_taken_as_written_and_its_breaches_are_not():
    form = JsonForm.from_schema(PERSON)
    good = {"name": "Bob", "age": 42, "tags": ["a", 3], "nick": None,
            "where": {"x": -1.5e3, "ok": True}, "kind": 'a"b', "any": [{}], "nothing": None}
    assert _whole(form, json.dumps(good).encode())
    assert _whole(form, json.dumps(good, indent=1).encode())
    for change in [{"name": "Bobbyy"}, {"name": ""}, {"age": 4.5}, {"tags": []},
                   {"tags": ["a", "a", "a"]}, {"tags": ["c"]}, {"nick": 3}, {"kind": "ab"},
                   {"where": {"ok": True, "x": 1}}, {"extra": 1}]:
        assert not _whole(form, json.dumps({**good, **change}).encode()), change
    assert not _whole(form, json.dumps({k: v for k, v in good.items() if k != "age"}).encode())


def test_a_pattern_or_format_string_matches_it_and_nothing_else():
    import datetime
    import re
    import uuid

    form = JsonForm.from_schema(DATED)
    good = {"day": "2026-12-03", "at": "2026-12-03T06:31:33.5+01:00",
            "id": "123e4567-e89b-12d3-a456-426614174000", "code": "AB-1234yz", "word": "abbbc"}
    text = json.dumps(good)
    assert _whole(form, text.encode())
    for change in [{"day": "2026-12-3"}, {"day": "2026/12/03"}, {"day": "2026-13-03"},
                   {"at": "2026-12-03 06:31:33Z"}, {"at": "2026-12-03T24:31:33Z"},
                   {"at": "2026-12-03T06:31:33"}, {"id": "123e4567e89b12d3a456426614174000"},
                   {"code": "AB-12"}, {"code": "ab-123"}, {"code": "AB-123x "}, {"word": "ac"},
                   {"word": "xabc"}]:
        assert not _whole(form, json.dumps({**good, **change}).encode()), change
    assert not _whole(form, text.replace("abbbc", "ab\\u0062bc").encode())   # no escapes
    anywhere = JsonForm.from_schema({"type": "object", "properties": {
        "w": {"type": "string", "pattern": "ab+c"}}})      # unanchored: a match anywhere
    assert _whole(anywhere, b'{"w": "x abbc!"}') and not _whole(anywhere, b'{"w": "x ac"}')
    rng = random.Random(11)
    for _ in range(20):                                    # random walks: each one parses
        s, out = form.start(), bytearray()
        while not complete(s) and len(out) < 1000:
            ok = [b for b, fits in enumerate(first_bytes(s)) if fits]
            out.append(rng.choice(ok))
            s = step(s, out[-1])
        if complete(s):
            v = json.loads(out.decode())
            y, m, d = v["day"].split("-")              # a day past its month's end may come
            datetime.date(int(y), int(m), min(int(d), 28))
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)",
                                v["at"])
            uuid.UUID(v["id"])
            assert re.search(r"^[A-Z]{2}-\d{3,5}(x|yz)?$", v["code"])
            assert re.search(r"^ab+c$", v["word"])


@pytest.mark.parametrize("schema, match", [
    ({"type": "string"}, "top level must be an object"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}},
     "lookarounds"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x",
                                             "maxLength": 3}}}, "with a length bound"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}},
     "format 'email' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "string",
                                             "pattern": "((a{64}){64}){64}"}}}, "too large"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}, "'minimum'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}, "names no subschema"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}, "only '#/\\$defs"),
    ({"type": "object", "$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}},
      "properties": {"t": {"$ref": "#/$defs/T"}}}, "refers back to itself"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/a", "type": "string"}}},
     "'type' is not supported"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "object"},
                                                       {"type": "object"}]}}}, "told apart"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"},
                                                       {"type": "number"}]}}}, "told apart"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3,
                                             "maxLength": 2}}}, "no value has both"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "not a JSON Schema type"),
    ({"type": "object", "required": ["b"], "properties": {"a": {}}}, "'b'"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "non-empty"),
    ("object", "a schema is an object"),
])
def test_a_schema_the_automaton_cannot_enforce_is_refused_by_name(schema, match):
    with pytest.raises(FormError, match=match):
        JsonForm.from_schema(schema)


_KEYS = st.sampled_from(["type", "properties", "required", "items", "enum", "const", "anyOf",
                         "oneOf", "minItems", "maxItems", "minLength", "maxLength",
                         "additionalProperties", "title", "pattern", "$ref", "$defs", "a"])
_JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["object", "string", "array", "integer", "number", "boolean", "null", "a", ""]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(_KEYS | st.text(max_size=2), c,
                                                        max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _JSONISH, max_size=5))
def test_any_json_given_as_a_schema_compiles_or_is_a_form_error(schema):
    """What a client may send (the service's schema check is this): never another exception."""
    whole = {"type": "object", "properties": {"x": schema}}
    try:
        form = JsonForm.from_schema(whole)
    except FormError:
        return
    rng, s, out = random.Random(len(repr(schema))), form.start(), bytearray()
    while not complete(s) and len(out) < 400:          # no dead end, and a whole text is valid
        ok = [b for b, fits in enumerate(first_bytes(s)) if fits]
        assert ok, f"a dead end after {bytes(out)!r}"
        short = [b for b in ok if b in b'}]",:0en']
        b = rng.choice(short if short and rng.random() < 0.8 else ok)
        out.append(b)
        s = step(s, b)
    rs = pytest.importorskip("jsonschema_rs")
    try:
        rs.validator_for(whole)
    except rs.ValidationError:
        return                          # not a JSON Schema (an annotation of the wrong type)
    if complete(s):
        assert rs.is_valid(whole, json.loads(out.decode())), (schema, bytes(out))


def test_a_schema_too_deep_or_too_large_is_refused():
    deep: dict = {"type": "object"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(FormError, match="too large"):
        JsonForm.from_schema(deep)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(600)}}
    with pytest.raises(FormError, match="too large"):
        JsonForm.from_schema(wide)


def test_token_pieces_become_the_bytes_they_decode_to():
    assert bytes_of_pieces(["Ġhello", "Ċ", '{"', "âĢĻ", None, ""]) == [
        b" hello", b"\n", b'{"', "\u2019".encode(), None, None]
    assert bytes_of_pieces(["\u2581the", "<0x0A>", "é", "x"]) == [
        b" the", b"\n", "é".encode(), b"x"]


# ---- the chooser over a small vocabulary ----------------------------------------------------------
EOS = 0
TEXTS = [None, b"{", b"}", b'"', b"a", b'":', b"1", b" ", b'{"a": 1}', b"x", b"}x", b"{{",
         b'"a"', b":", b",", b"2"]
ID = {t: i for i, t in enumerate(TEXTS)}


def _vocab(texts=TEXTS) -> TokenBytes:
    return TokenBytes(list(texts), (EOS,))


def _chooser(vocab: TokenBytes | None = None, **kw) -> TokenChooser:
    return TokenChooser(Sampling(form=JsonForm.any_object(), **kw), vocab or _vocab())


def _logits(prefer: dict[bytes | None, float], n: int = len(TEXTS)) -> torch.Tensor:
    x = torch.zeros(n)
    for t, v in prefer.items():
        x[ID[t]] = v
    return x


def test_greedy_takes_the_most_likely_token_whose_whole_text_fits():
    choose = _chooser()
    # 'x' is no JSON; '}x' and '{{' begin with a byte that fits but do not fit whole
    assert choose(_logits({b"x": 9, b"}x": 8, b"{{": 7, b"{": 1})) == ID[b"{"]
    assert choose(_logits({b"}x": 9, b'"a"': 5, b"}": 1})) == ID[b'"a"']
    assert choose(_logits({None: 9, b":": 1})) == ID[b":"]        # no end before it is whole
    assert choose(_logits({b"1": 3})) == ID[b"1"]
    assert choose(_logits({b"}": 3, b"2": 4})) == ID[b"2"]
    assert choose(_logits({b"}": 3})) == ID[b"}"]
    assert choose(_logits({b"{": 9})) == EOS                       # whole: the end, always
    assert choose(_logits({b"1": 9})) == EOS


def test_sampled_tokens_are_drawn_among_those_that_fit_in_their_proportions():
    choose = _chooser(temperature=1.0, seed=5)
    assert choose(_logits({b'{"a": 1}': 0.0})) in (ID[b"{"], ID[b'{"a": 1}'], ID[b" "])
    guide = FormGuide(JsonForm.any_object(), _vocab())
    guide.advance(ID[b"{"])
    fits = {t for t in range(len(TEXTS)) if guide.fits(t)}
    assert fits == {ID[b"}"], ID[b'"'], ID[b'"a"'], ID[b'":'], ID[b" "]}   # '":' opens a key
    counts = torch.zeros(len(TEXTS))
    for seed in range(4000):
        c = _chooser(temperature=1.0, seed=seed)
        c(_logits({b"{": 50}))
        counts[c(torch.zeros(len(TEXTS)))] += 1
    share = counts / counts.sum()
    assert set(torch.nonzero(counts).flatten().tolist()) == fits
    assert all(abs(float(share[t]) - 0.2) < 0.03 for t in fits)


def test_past_the_tries_every_candidate_is_tried_and_a_dead_end_ends_the_answer():
    texts = [None, b"{", b"}"] + [b"{x%d" % i for i in range(40)]
    vocab = _vocab(texts)
    x = torch.zeros(len(texts))
    x[3:] = 10.0                           # 40 tokens that begin with '{' and do not fit
    assert _chooser(vocab)(x) == 1
    assert _chooser(vocab, temperature=1.0, seed=1)(x) == 1
    stuck = _chooser(_vocab([None, b"{", b"x"]))
    assert stuck(torch.tensor([0.0, 5.0, 1.0])) == 1
    assert stuck(torch.tensor([0.0, 5.0, 1.0])) == EOS   # nothing after '{' fits: the end


@pytest.mark.parametrize("schema", [PERSON, UNION, {"type": "object"}])
def test_the_walk_over_the_sorted_vocabulary_finds_exactly_the_tokens_that_fit(schema):
    rng = random.Random(3)
    alphabet = b'{}[]":, \n0123456789.-eEtruefalsn\\abxy\xc3\xa9\xff'
    texts = sorted({bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                    for _ in range(3000)} | {bytes([b]) for b in range(256)})
    rng.shuffle(texts)
    vocab = TokenBytes([None] + texts, (0,))
    form = JsonForm.from_schema(schema)
    guide, seen = FormGuide(form, vocab), 0
    for _ in range(60):                     # the states of a random answer over this vocabulary
        want = [t for t in range(len(vocab)) if guide.fits(t)]   # end-of-sequence (0) too
        assert sorted(guide.fitting()) == want
        if guide.whole:
            break
        guide.advance(rng.choice([t for t in want if t]))
        seen += 1
    assert seen >= 20


def test_a_form_needs_the_vocabulary_and_its_end_token():
    with pytest.raises(ValueError, match="vocabulary"):
        TokenChooser(Sampling(form=JsonForm.any_object()))
    with pytest.raises(ValueError, match="end-of-sequence"):
        TokenChooser(Sampling(form=JsonForm.any_object()), TokenBytes([b"{"], ()))


# ---- through the generation paths (a random model, a vocabulary of JSON's pieces) ---------------
SMALL = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "s": {"type": "string", "maxLength": 4}}}


@pytest.fixture
def json_llama(tiny_llama):
    """The tiny model with a vocabulary: ASCII's printable bytes and JSON's pieces; id 2 ends."""
    pieces = [b"true", b"false", b'{"', b'":', b'",', b", ", b'": ', b"[", b"]}", b"null",
              b'"ok"', b"{}", b"\n  ", b"30"]
    texts: list[bytes | None] = [None] * 128
    for i, p in zip([0, 1] + list(range(3, 15)), pieces):
        texts[i] = p
    for i in range(32, 127):
        texts[i] = bytes([i])
    tiny_llama.extra["token_bytes"] = TokenBytes(texts, (2,))
    yield tiny_llama
    del tiny_llama.extra["token_bytes"]


@pytest.fixture(scope="module")
def context(tiny_llama):
    from sparkv.runtime import reference_prefill

    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        return reference_prefill(tiny_llama, ids)


def _value(lm, tokens: list[int]) -> object:
    texts = lm.extra["token_bytes"].texts
    cut = tokens.index(2)
    assert set(tokens[cut:]) == {2}        # once whole, only the end (this model has no eos id)
    return json.loads(b"".join(texts[t] for t in tokens[:cut]))


@pytest.mark.parametrize("rule", [dict(), dict(temperature=1.5, seed=3),
                                  dict(temperature=1.0, top_p=0.9, seed=4)])
def test_every_generation_path_answers_a_value_of_the_schema(json_llama, context, tmp_path,
                                                            rule):
    rs = pytest.importorskip("jsonschema_rs")
    from sparkv.decode import generate
    from sparkv.runtime import greedy_generate

    sampling = Sampling(form=JsonForm.from_schema(SMALL), **rule)
    got = greedy_generate(json_llama, context, 64, [3, 9, 27], max_new_tokens=160,
                          stop_at_eos=False, sampling=sampling)
    assert rs.is_valid(SMALL, _value(json_llama, got.tokens))
    dyn, _ = generate(json_llama, context, 64, [3, 9, 27], 160, kv_policy="dynakv", budget=1.0,
                      ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, avg_cluster=8,
                      max_cluster=16, recent=8, sampling=sampling)
    assert dyn.tokens == got.tokens        # a budget holding everything: full KV's tokens
    free = greedy_generate(json_llama, context, 64, [3, 9, 27], max_new_tokens=40,
                           stop_at_eos=False, sampling=Sampling(**rule))
    assert free.tokens != got.tokens       # the form is what made them JSON


def test_a_union_decided_only_by_a_later_byte_reads_every_branch_until_one_is_left():
    form = JsonForm.from_schema(TWOFOLD)
    good = {"v": {"kind": "a", "z": True}, "n": 2.5, "w": {"t": 2, "a": None}, "s": "abc"}
    assert _whole(form, json.dumps(good).encode())
    for v in ({"kind": "a", "x": 3}, {"kind": "b", "y": "ab"}):
        assert _whole(form, json.dumps({**good, "v": v, "n": 7}).encode())
    for bad in ({"v": {"kind": "b", "x": 3}}, {"v": {"kind": "a", "y": "ab"}},
                {"w": {"t": 3, "a": None}}, {"s": 1}, {"n": "1"}):
        assert not _whole(form, json.dumps({**good, **bad}).encode()), bad
    s = form.start()
    for b in b'{"v": {"kind": "a", ':
        s = step(s, b)
    assert s[0] == "|" and len(s[1]) == 2        # the two "a" objects, both still going
    assert step(s, ord('"')) is not None and next_key(s)[0] == "|"


def test_parts_around_json_read_exact_text_prose_sequences_and_repeats():
    from sparkv.runtime.formparts import (object_part, one_of, raw_part, repeated, sequence,
                                          text_part, ANY_STRING)
    from sparkv.runtime.jsonform import END, feed, may_end

    call = sequence(raw_part("<a>"), object_part([("q", ANY_STRING)]), raw_part("</a>"))
    form = JsonForm.of(one_of(text_part(refused=("<a>",)), repeated(call, 1, 2)))
    one, two = b'<a>{"q": "x"}</a>', b'<a>{"q":"y"}</a><a> {"q": ""}</a>'
    for text in (one, two):
        s = feed(form.start(), text)
        assert s is not None and may_end(s), text
    assert complete(feed(form.start(), two))             # at most two: nothing may follow
    assert not complete(feed(form.start(), one))         # another may
    assert feed(form.start(), b" <a>") is not None       # prose, as it does not begin with <a>
    assert feed(form.start(), b"<a> {") is not None      # a call: JSON may follow whitespace
    assert feed(form.start(), b"<a>x") is None           # neither prose nor a call
    for after in (b"x", b" "):                            # nothing but another call follows
        assert feed(form.start(), one + after) is None
    prose = feed(form.start(), "a caf\u00e9".encode())
    assert prose is not None and may_end(prose) and not complete(prose)
    assert not may_end(feed(form.start(), b"caf\xc3"))    # inside a character
    assert feed(form.start(), b"caf\xc3(") is None and feed(form.start(), b"\xff") is None
    assert not may_end(feed(form.start(), b"<a>"))       # a call begun is not an end
    assert step(form.start(), END) is not None            # empty prose is an answer
    assert next_key(feed(form.start(), b"xy")) == next_key(feed(form.start(), b"xyz"))


def test_parts_that_cannot_be_are_refused_and_so_is_a_form_too_ambiguous():
    from sparkv.runtime.formparts import (MAX_ALTERNATIVES, FormError as PartError, const_part,
                                          object_part, one_of, raw_part, repeated, sequence,
                                          text_part)

    assert PartError is FormError
    for make in (lambda: raw_part(""), lambda: sequence(text_part(), raw_part("x")),
                 lambda: repeated(text_part()), lambda: repeated(raw_part("x"), 3, 2),
                 lambda: one_of(),
                 lambda: object_part([("a", const_part(1)), ("a", const_part(2))]),
                 lambda: text_part(refused=("",))):
        with pytest.raises(FormError):
            make()
    wide = one_of(*(raw_part("x%d" % i) for i in range(MAX_ALTERNATIVES + 1)))
    with pytest.raises(FormError, match="ambiguous"):
        JsonForm.of(wide)
    strings = {"anyOf": [{"type": "string"}] * 30}          # 30 readings, referred to 20 times
    with pytest.raises(FormError, match="ambiguous"):
        JsonForm.from_schema({"type": "object", "$defs": {"s": strings}, "properties": {
            "a": {"anyOf": [{"$ref": "#/$defs/s"}] * 20}}})


def test_the_chooser_ends_prose_where_the_model_would_and_never_inside_a_character():
    from sparkv.runtime.formparts import text_part

    vocab = _vocab([None, b"hi", b"\xc3", b"\xa9"])
    chooser = TokenChooser(Sampling(form=JsonForm.of(text_part())), vocab)
    assert chooser(torch.tensor([9.0, 1.0, 0.0, 0.0])) == EOS and chooser.finished
    chooser = TokenChooser(Sampling(form=JsonForm.of(text_part())), vocab)
    assert chooser(torch.tensor([1.0, 0.0, 9.0, 0.0])) == 2      # half a character
    assert chooser(torch.tensor([9.0, 0.0, 0.0, 1.0])) == 3      # no end inside it
    assert not chooser.finished
    assert chooser(torch.tensor([9.0, 0.0, 0.0, 1.0])) == EOS and chooser.finished
