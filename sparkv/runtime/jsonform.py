"""The JSON an answer must be (OpenAI's ``response_format``), as a byte-level automaton.

A :class:`JsonForm` is compiled once per request: :meth:`JsonForm.any_object` (``json_object``:
any JSON object) or :meth:`JsonForm.from_schema` (``json_schema``: a JSON Schema, the part
structured outputs use). Its automaton reads an answer's bytes one at a time:
:meth:`JsonForm.start` is the state before the first, :func:`step` the state after a byte
(``None``: no text of the form begins so), :func:`complete` whether the text so far is a whole
value. A state is an immutable tuple, so a chooser tries a token's bytes from one state without
copying it (:mod:`sparkv.runtime.guided`).

What a schema's text is:

* an object has every property its schema lists, in the schema's order, and no other (what a
  strict schema asks for; ``required`` names a subset of them, and every property present
  satisfies it); an object schema with no ``properties`` takes any keys and values;
* an array's items each match ``items`` (any value without it), between ``minItems`` and
  ``maxItems``;
* a string is any JSON string (escapes checked, UTF-8 checked) of ``minLength`` to ``maxLength``
  characters, or one of printable ASCII that matches its ``pattern`` or ``format`` (``date``,
  ``time``, ``date-time``, ``uuid``; :mod:`sparkv.runtime.jsonregex`);
* ``integer`` has no fraction or exponent; ``number`` is a JSON number of at most
  :data:`MAX_NUMBER_BYTES` bytes and a two-digit exponent (so every number is a finite double);
* ``enum`` and ``const`` are their values' compact JSON texts; ``boolean`` and ``null`` theirs;
* ``type`` as a list and ``anyOf``: a value of any branch. The automaton reads every branch
  that still fits until one is left (two objects of different properties, say; at most
  :data:`~sparkv.runtime.formparts.MAX_ALTERNATIVES` alternatives at once). ``oneOf`` also asks
  that no text be of two branches: they begin differently, or are objects whose properties
  differ or hold different consts (its ``discriminator`` is read as a hint only).

* ``$ref`` names a subschema of the root's ``$defs`` (or ``definitions``), as pydantic and the
  ``openai`` client's ``parse()`` write them; a ``$ref`` that comes back to itself (a recursive
  schema) is refused.

Keywords that only annotate (``title``, ``description``, ``$schema``, ``default``, ...) are
ignored; any other (``minimum``, ``multipleOf``, ``uniqueItems``, ...) is a :class:`FormError`
naming it, never a constraint silently dropped. Whitespace between tokens of the JSON text is
allowed, at most :data:`MAX_WHITESPACE` bytes in a row (a model may otherwise emit newlines
until its token cap).

A form may also be made of parts around JSON (:meth:`JsonForm.of`,
:mod:`sparkv.runtime.formparts`): exact text, prose, sequences, repeats and unions; a tool
call's form is one (:mod:`sparkv.runtime.toolform`). Prose has no end of its own: :func:`may_end` tells where the
answer may end (end-of-sequence may come), :func:`complete` where it must (nothing may follow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sparkv.runtime.formparts import (ANY, ANY_NUMBER, ANY_STRING, BY_FIRST, MAX_ALTERNATIVES,
                                     AnyValue, ArrayPart, FormError, Node, NumberPart,
                                     ObjectPart, RawPart, RepeatPart, SequencePart, StringPart,
                                     TextPart, UnionPart, form_width)
from sparkv.runtime.formschema import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, schema_node

__all__ = ["JsonForm", "FormError", "State", "END", "step", "feed", "complete", "may_end",
           "first_bytes", "next_key",
           "MAX_WHITESPACE", "MAX_NUMBER_BYTES", "MAX_SCHEMA_NODES", "MAX_SCHEMA_DEPTH"]

#: the most whitespace bytes in a row outside strings
MAX_WHITESPACE = 16
#: the longest number's text
MAX_NUMBER_BYTES = 32



@dataclass(frozen=True, eq=False)
class JsonForm:
    """What an answer's text must be: a JSON value of :attr:`root`'s schema (an object)."""

    root: Node
    name: str = "json_object"
    #: where the answer ends before its value is whole: given the text so far wherever it may
    #: end, ``True`` ends it there (a tool form's: its last call repeats one it made)
    ends: Callable[[bytes], bool] | None = None

    def __repr__(self) -> str:                  # a rule's repr names its form, not its nodes
        return f"JsonForm({self.name!r})"

    @classmethod
    def any_object(cls) -> "JsonForm":
        """OpenAI's ``json_object``: any JSON object."""
        return cls(ObjectPart(None))

    @classmethod
    def of(cls, root: Node, name: str = "form",
           ends: Callable[[bytes], bool] | None = None) -> "JsonForm":
        """A form of any parts (:class:`FormError` if its automaton could hold more than
        :data:`~sparkv.runtime.formparts.MAX_ALTERNATIVES` alternatives at once), ending early
        where ``ends`` says (:attr:`ends`)."""
        width = form_width(root)
        if width > MAX_ALTERNATIVES:
            raise FormError(f"the form is too ambiguous: up to {width} readings at once (at "
                            f"most {MAX_ALTERNATIVES}); give unions' branches different "
                            "beginnings")
        return cls(root, name, ends)

    @classmethod
    def from_schema(cls, schema: Any, name: str = "schema") -> "JsonForm":
        """OpenAI's ``json_schema``: a value of ``schema``, whose top level is an object
        (:class:`FormError` for what the automaton cannot enforce)."""
        root = schema_node(schema)
        if not isinstance(root, ObjectPart):
            raise FormError("schema: the top level must be an object schema "
                            "({'type': 'object', ...}), as OpenAI's structured outputs ask")
        return cls.of(root, name)

    def start(self) -> "State":
        """The state before the answer's first byte."""
        return ((_enter(self.root),), 0)


# ---- the automaton ---------------------------------------------------------------------------------
#: ``(stack of frames, whitespace bytes in a row)``, a frame a tuple with its kind first; or
#: ``("|", states)``: the text so far read several ways, each still going
State = tuple

#: the end of the answer, as a byte no text holds (:func:`may_end`)
END = 256

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
#: frames where whitespace may come (before a value, around punctuation)
_BETWEEN = frozenset({"V", "O0", "OK", "OC", "OA", "PK", "PC", "PA", "PE", "A0", "A1"})


class _Fork(tuple):
    """A handler's answer when the byte may be read several ways: each a tuple of frames that
    replaces the top one, and reads the byte anew."""


def step(state: State, byte: int) -> State | None:
    """The state after ``byte`` (or :data:`END`); ``None`` if no text of the form goes on with
    it."""
    if state[0] == "|":
        return _join([step(s, byte) for s in state[1]])
    stack, ws = state
    while stack:
        top = stack[-1]
        if byte in _WS and top[0] in _BETWEEN:
            return (stack, ws + 1) if ws < MAX_WHITESPACE else None
        out = _HANDLERS[top[0]](top, byte)
        if out is None:
            return None
        if isinstance(out, _Fork):
            return _join([step((stack[:-1] + way, ws), byte) for way in out])
        frames, consumed = out
        stack = stack[:-1] + frames
        if consumed:
            while stack and _done(stack[-1]):
                stack = stack[:-1]
            return stack, 0
    return ((), 0) if byte == END else None       # whole: only the answer's end may follow


def _done(frame: tuple) -> bool:
    """Whether a sequence or repeat has read all it may (so :func:`complete` sees its end)."""
    if frame[0] == "Q":
        return frame[2] == len(frame[1].parts)
    return frame[0] == "P" and frame[2] == frame[1].most


def _join(states: list[State | None]) -> State | None:
    """The states still going, as one (a union when more than one differs)."""
    ways: dict[State, None] = {}
    for s in states:
        if s is not None:
            ways.update(dict.fromkeys(s[1] if s[0] == "|" else (s,)))
    if len(ways) <= 1:
        return next(iter(ways), None)
    return ("|", tuple(ways))


def feed(state: State | None, data: bytes) -> State | None:
    """The state after ``data`` (``None`` as soon as a byte does not fit)."""
    for b in data:
        if state is None:
            return None
        state = step(state, b)
    return state


def complete(state: State) -> bool:
    """Whether the text so far is whole and nothing may follow it (every reading of it)."""
    if state[0] == "|":
        return all(complete(s) for s in state[1])
    return not state[0]


def may_end(state: State) -> bool:
    """Whether the answer may end here (a whole value, or prose at a character's end)."""
    return step(state, END) is not None


def first_bytes(state: State) -> list[bool]:
    """For each byte value, whether the text may go on with it."""
    return [step(state, b) is not None for b in range(256)]


def next_key(state: State) -> tuple:
    """A key equal for any two states after which the same bytes may come (:func:`first_bytes`
    is the same): a string's length and a number's only as far as their bounds tell, whether
    more whitespace may come. Inside a string every state has one key, so a chooser works out
    what may come there once per answer."""
    if state[0] == "|":
        return ("|",) + tuple(next_key(s) for s in state[1])
    stack, ws = state
    top = stack[-1] if stack else ()
    if top and top[0] == "S":
        _, node, chars, escape, utf8 = top
        top = ("S", node, chars >= node.min_len,
               node.max_len is None or chars < node.max_len, escape, utf8)
    elif top and top[0] == "T":
        top = top[:2] + (top[2] is not None and top[2],) + top[3:]
    elif top and top[0] == "N":
        top = ("N", top[1], top[2], top[3] < MAX_NUMBER_BYTES)
    return stack[:-1], top, ws < MAX_WHITESPACE


def _value(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    node = top[1]
    if isinstance(node, UnionPart):
        return _Fork((("V", b),) for b in node.branches if byte in b.first) or None
    if byte not in node.first:
        return None
    if isinstance(node, AnyValue):
        node = BY_FIRST.get(byte, ANY_NUMBER)
    if isinstance(node, ObjectPart):
        if node.props is None:
            return (("O0", node),), True
        return ((("PK", node, 0),) if node.props else (("PE", node),)), True
    if isinstance(node, ArrayPart):
        return (("A0", node),), True
    if isinstance(node, StringPart):
        if node.pattern is not None:
            return (("R", node, node.pattern.start()),), True
        return (("S", node, 0, 0, 0),), True
    if isinstance(node, NumberPart):
        return (("N", node, 0, 0),), False
    return (("L", node.texts, 0),), False


def _free_object(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    kind, node = top[0], top[1]
    if kind == "O0" and byte == ord("}"):
        return (), True
    if kind in ("O0", "OK") and byte == ord('"'):
        return (("OC", node), ("S", ANY_STRING, 0, 0, 0)), True
    if kind == "OC" and byte == ord(":"):
        return (("OA", node), ("V", ANY)), True
    if kind == "OA" and byte == ord(","):
        return (("OK", node),), True
    if kind == "OA" and byte == ord("}"):
        return (), True
    return None


def _schema_object(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    kind, node = top[0], top[1]
    if kind == "PE":
        return ((), True) if byte == ord("}") else None
    i = top[2]
    if kind == "PK":
        key = node.props[i][0]
        return ((("PC", node, i), ("L", (key,), 1)), True) if byte == key[0] else None
    if kind == "PC":
        return ((("PA", node, i), ("V", node.props[i][1])), True) if byte == ord(":") else None
    last = i + 1 == len(node.props)
    if byte == ord(",") and not last:
        return (("PK", node, i + 1),), True
    if byte == ord("}") and last:
        return (), True
    return None


def _array(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    kind, node = top[0], top[1]
    count = top[2] if kind == "A1" else 0
    hi = node.max_items
    if byte == ord("]"):
        return ((), True) if count >= node.min_items else None
    if kind == "A1":
        if byte == ord(",") and (hi is None or count < hi):
            return (("A1", node, count + 1), ("V", node.items)), True
        return None
    if (hi is None or hi > 0) and byte in node.items.first:
        return (("A1", node, 1), ("V", node.items)), False
    return None


def _string(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    _, node, chars, escape, utf8 = top
    if utf8:                                      # inside a multi-byte character
        more, lo, hi = utf8
        if not lo <= byte <= hi:
            return None
        return (("S", node, chars + (more == 1), 0, (more - 1, 0x80, 0xBF) if more > 1 else 0),
                ), True
    if escape:                                    # after a backslash, or in \uXXXX
        if escape == 1:
            if byte == ord("u"):
                return (("S", node, chars, 5, 0),), True
            return ((("S", node, chars + 1, 0, 0),), True) if byte in _ESCAPES else None
        if byte not in _HEX:
            return None
        return (("S", node, chars + (escape == 2), escape - 1 if escape > 2 else 0, 0),), True
    if byte == ord('"'):
        return ((), True) if chars >= node.min_len else None
    if byte < 0x20 or (node.max_len is not None and chars >= node.max_len):
        return None
    if byte == ord("\\"):
        return (("S", node, chars, 1, 0),), True
    if byte < 0x80:
        return (("S", node, chars + 1, 0, 0),), True
    lead = _UTF8_LEADS.get(byte)
    return ((("S", node, chars, 0, lead),), True) if lead else None


def _utf8_leads() -> dict[int, tuple[int, int, int]]:
    """A UTF-8 lead byte -> (continuation bytes, the first one's range): no overlong form, no
    surrogate, nothing past U+10FFFF."""
    leads = {b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}
    leads.update({b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0)})
    leads.update({b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)})
    leads.update({0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F), 0xF0: (3, 0x90, 0xBF),
                  0xF4: (3, 0x80, 0x8F)})
    return leads


_UTF8_LEADS = _utf8_leads()


#: a number's phases: what may come next, and whether the text so far is a whole number
#: (``#``: a digit, and ``0`` at a number's first digit; ``E``: ``e`` or ``E``)
_NUMBER_NEXT = {0: {"-": 1, "0": 2, "#": 3}, 1: {"0": 2, "#": 3}, 2: {".": 4, "E": 6},
                3: {"#": 3, ".": 4, "E": 6}, 4: {"#": 5}, 5: {"#": 5, "E": 6},
                6: {"+": 7, "-": 7, "#": 8, "0": 8}, 7: {"#": 8, "0": 8}, 8: {"#": 9, "0": 9},
                9: {}}
_NUMBER_WHOLE = frozenset({2, 3, 5, 8, 9})


def _patterned(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    """A string whose text must match its pattern: printable ASCII, no escapes."""
    _, node, states = top
    if byte == ord('"'):
        return ((), True) if node.pattern.accepts(states) else None
    nxt = node.pattern.step(states, byte) if 0x20 <= byte < 0x7F and byte != 0x5C else None
    return ((("R", node, nxt),), True) if nxt else None


def _number(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    _, node, phase, length = top
    c = chr(byte)
    sym = ("#" if byte in _DIGITS and not (c == "0" and phase in (0, 1, 6, 7, 8))
           else "E" if c in "eE" else c if c in "-+.0" else "")
    nxt = _NUMBER_NEXT[phase].get(sym)
    if nxt is not None and node.integer and sym in (".", "E"):
        nxt = None
    if nxt is not None and (length < MAX_NUMBER_BYTES or phase not in _NUMBER_WHOLE):
        return (("N", node, nxt, length + 1),), True
    return ((), False) if phase in _NUMBER_WHOLE else None


def _literal(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    _, texts, pos = top
    going = tuple(t for t in texts if len(t) > pos and t[pos] == byte)
    if going:
        if all(len(t) == pos + 1 for t in going):
            return (), True                       # one text matched whole, none goes on
        return (("L", going, pos + 1),), True
    if any(len(t) == pos for t in texts):
        return (), False                          # a text ended here; the byte is the parent's
    return None


def _enter(node: Node) -> tuple:
    """The frame that reads ``node``'s text (a JSON value's: whitespace may come first)."""
    if isinstance(node, RawPart):
        return ("L", (node.text,), 0)
    if isinstance(node, TextPart):
        return ("T", node, b"", 0)
    if isinstance(node, SequencePart):
        return ("Q", node, 0)
    if isinstance(node, RepeatPart):
        return ("P", node, 0)
    if isinstance(node, UnionPart):
        return ("U", node)
    return ("V", node)


def _union(top: tuple, byte: int) -> _Fork:
    return _Fork((_enter(b),) for b in top[1].branches)


def _sequence(top: tuple, byte: int) -> tuple[tuple, bool]:
    _, node, i = top
    if i == len(node.parts):
        return (), False
    return (("Q", node, i + 1), _enter(node.parts[i])), False


def _repeat(top: tuple, byte: int) -> _Fork:
    _, node, count = top
    ways: list[tuple] = []
    if node.most is None or count < node.most:
        ways.append((("P", node, count + 1), _enter(node.part)))
    if count >= node.least:
        ways.append(())
    return _Fork(ways)


def _text(top: tuple, byte: int) -> tuple[tuple, bool] | None:
    """Prose: UTF-8 (no overlong form, no surrogate), not beginning with a refused text;
    ``seen``: the text so far while it is a refused one's beginning, else ``None``."""
    _, node, seen, utf8 = top
    if byte == END:
        return ((), False) if not utf8 else None
    if utf8:
        more, lo, hi = utf8
        if not lo <= byte <= hi:
            return None
        utf8 = (more - 1, 0x80, 0xBF) if more > 1 else 0
    elif byte >= 0x80:
        utf8 = _UTF8_LEADS.get(byte)
        if utf8 is None:
            return None
    if seen is not None:
        seen += bytes([byte])
        if seen in node.refused:
            return None
        if not any(r.startswith(seen) for r in node.refused):
            seen = None
    return (("T", node, seen, utf8),), True


_HANDLERS = {"V": _value, "U": _union, "Q": _sequence, "P": _repeat, "T": _text,
             "O0": _free_object, "OK": _free_object, "OC": _free_object,
             "OA": _free_object, "PK": _schema_object, "PC": _schema_object,
             "PA": _schema_object, "PE": _schema_object, "A0": _array, "A1": _array,
             "S": _string, "R": _patterned, "N": _number, "L": _literal}
