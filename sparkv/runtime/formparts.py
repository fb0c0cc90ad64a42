"""The parts a form is made of: one node per piece of an answer's text, and
:class:`FormError` for what no form can be.

* JSON values: :data:`ANY`, :class:`ObjectPart`, :class:`ArrayPart`, :class:`StringPart`,
  :class:`NumberPart`, :class:`LiteralPart` (what a JSON Schema compiles to);
* text around them: :class:`RawPart` (exact bytes), :class:`TextPart` (prose, UTF-8, refusing
  to begin with given texts), :class:`SequencePart` (parts one after another) and
  :class:`RepeatPart` (one part, a bounded number of times);
* :class:`UnionPart`: any one of its branches. Branches may begin alike: the automaton reads
  every one that still fits until one is left (:func:`form_width` bounds how many at once).

The constructors (:func:`raw_part`, :func:`text_part`, :func:`sequence`, :func:`repeated`,
:func:`one_of`, :func:`object_part`, :func:`const_part`) check what they are given.

:mod:`sparkv.runtime.formschema` compiles a JSON Schema into these nodes;
:mod:`sparkv.runtime.jsonform` reads an answer's bytes against them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from sparkv.runtime.jsonregex import Pattern

__all__ = ["FormError", "Node", "AnyValue", "ObjectPart", "ArrayPart", "StringPart", "NumberPart",
           "LiteralPart", "UnionPart", "RawPart", "TextPart", "SequencePart", "RepeatPart",
           "ANY", "ANY_OBJECT", "ANY_ARRAY", "ANY_STRING", "ANY_NUMBER", "TRUE_FALSE_NULL",
           "BY_FIRST", "json_text", "raw_part", "text_part", "sequence", "repeated", "one_of",
           "object_part", "const_part", "form_width", "MAX_ALTERNATIVES"]

#: the most alternatives a form's automaton may hold at once (:func:`form_width`)
MAX_ALTERNATIVES = 512


class FormError(ValueError):
    """A schema this automaton cannot enforce (or no schema at all)."""


class Node:
    """A subschema; ``first``: the bytes its value's text may begin with."""

    first: frozenset[int] = frozenset()


@dataclass(eq=False)
class AnyValue(Node):
    first = frozenset(b'{["-0123456789tfn')


@dataclass(eq=False)
class ObjectPart(Node):
    props: tuple[tuple[bytes, Node], ...] | None   # None: any keys and values
    first = frozenset(b"{")


@dataclass(eq=False)
class ArrayPart(Node):
    items: Node
    min_items: int = 0
    max_items: Optional[int] = None
    first = frozenset(b"[")


@dataclass(eq=False)
class StringPart(Node):
    min_len: int = 0
    max_len: Optional[int] = None
    pattern: Optional[Pattern] = None           # its text matches it (printable ASCII only)
    first = frozenset(b'"')


@dataclass(eq=False)
class NumberPart(Node):
    integer: bool = False
    first = frozenset(b"-0123456789")


@dataclass(eq=False)
class LiteralPart(Node):
    texts: tuple[bytes, ...]

    def __post_init__(self) -> None:
        self.first = frozenset(t[0] for t in self.texts)


@dataclass(eq=False)
class UnionPart(Node):
    branches: tuple[Node, ...]

    def __post_init__(self) -> None:
        self.first = frozenset().union(*(b.first for b in self.branches))


@dataclass(eq=False)
class RawPart(Node):
    """Exactly these bytes, with nothing (no whitespace) before them."""

    text: bytes

    def __post_init__(self) -> None:
        self.first = frozenset(self.text[:1])


@dataclass(eq=False)
class TextPart(Node):
    """Prose: any UTF-8 text (checked as read) that does not begin with one of ``refused``. It
    has no end of its own: it ends where the answer does."""

    refused: tuple[bytes, ...] = ()
    first = frozenset(range(256))


@dataclass(eq=False)
class SequencePart(Node):
    """Its parts' texts one after another."""

    parts: tuple[Node, ...]

    def __post_init__(self) -> None:
        self.first = self.parts[0].first


@dataclass(eq=False)
class RepeatPart(Node):
    """``part``'s text ``least`` to ``most`` times in a row."""

    part: Node
    least: int = 1
    most: Optional[int] = None

    def __post_init__(self) -> None:
        self.first = self.part.first


ANY = AnyValue()
ANY_STRING = StringPart()
ANY_OBJECT = ObjectPart(None)
ANY_ARRAY = ArrayPart(ANY)
ANY_NUMBER = NumberPart()
TRUE_FALSE_NULL = LiteralPart((b"true", b"false", b"null"))
#: what a value of any kind is, by its first byte
BY_FIRST = {ord("{"): ANY_OBJECT, ord("["): ANY_ARRAY, ord('"'): ANY_STRING,
             ord("t"): TRUE_FALSE_NULL, ord("f"): TRUE_FALSE_NULL, ord("n"): TRUE_FALSE_NULL}



def json_text(value: Any) -> bytes:
    """A JSON value's compact text (keys in their order, non-ASCII as itself)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def raw_part(text: str | bytes) -> RawPart:
    """Exactly ``text`` (not empty)."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    if not data:
        raise FormError("a raw part's text is not empty")
    return RawPart(data)


def text_part(refused: tuple[str, ...] = ()) -> TextPart:
    """Prose that does not begin with any of ``refused`` (each not empty)."""
    if any(not r for r in refused):
        raise FormError("a refused beginning is not empty")
    return TextPart(tuple(r.encode() for r in refused))


def sequence(*parts: Node) -> Node:
    """The parts' texts one after another (prose only last: it has no end of its own)."""
    if not parts:
        raise FormError("a sequence has at least one part")
    if any(_open_ended(p) for p in parts[:-1]):
        raise FormError("prose has no end of its own: only a sequence's last part may be prose")
    return parts[0] if len(parts) == 1 else SequencePart(tuple(parts))


def repeated(part: Node, least: int = 1, most: int | None = None) -> RepeatPart:
    """``part`` ``least`` to ``most`` times (``None``: no bound) in a row."""
    if _open_ended(part) or isinstance(part, TextPart):
        raise FormError("prose cannot repeat: it has no end of its own")
    if least < 0 or (most is not None and most < max(least, 1)):
        raise FormError(f"a part repeats {least} to {most} times: no count is both")
    return RepeatPart(part, least, most)


def one_of(*branches: Node) -> Node:
    """Any one of ``branches`` (nested unions flattened)."""
    flat: list[Node] = []
    for b in branches:
        flat.extend(b.branches if isinstance(b, UnionPart) else (b,))
    if not flat:
        raise FormError("a union has at least one branch")
    return flat[0] if len(flat) == 1 else UnionPart(tuple(flat))


def object_part(props: list[tuple[str, Node]]) -> ObjectPart:
    """An object of exactly these properties, in this order."""
    keys = [k for k, _ in props]
    if len(set(keys)) != len(keys):
        raise FormError("an object's properties have distinct names")
    return ObjectPart(tuple((json_text(k), n) for k, n in props))


def const_part(value: Any) -> LiteralPart:
    """Exactly this JSON value."""
    return LiteralPart((json_text(value),))


def _open_ended(node: Node) -> bool:
    """Whether ``node``'s text may go on without end of its own (prose in it, last)."""
    if isinstance(node, TextPart):
        return True
    if isinstance(node, SequencePart):
        return _open_ended(node.parts[-1])
    if isinstance(node, UnionPart):
        return any(_open_ended(b) for b in node.branches)
    return False


def form_width(node: Node, _memo: dict[int, int] | None = None) -> int:
    """A bound on how many alternatives the automaton holds at once inside ``node``'s text: a
    union's branches add up, a part inside another counts once (one is open at a time), and a
    repeat adds one (another round, or the end)."""
    memo = {} if _memo is None else _memo
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, UnionPart):
        width = sum(form_width(b, memo) for b in node.branches)
    elif isinstance(node, ObjectPart) and node.props:
        width = max(form_width(n, memo) for _, n in node.props)
    elif isinstance(node, ArrayPart):
        width = form_width(node.items, memo)
    elif isinstance(node, SequencePart):
        width = max(form_width(p, memo) for p in node.parts)
    elif isinstance(node, RepeatPart):
        width = form_width(node.part, memo) + 1
    else:
        width = 1
    memo[id(node)] = width
    return width
